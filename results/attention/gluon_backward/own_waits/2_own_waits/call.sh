#!/bin/bash
# H100, Triton 3.9.0 with the machine's ptxas (12.9 for Hopper): own_waits against the kernel as it is, no benchmark.
VARIANTS="default= own=own_waits:1" SWEEP_S=200 BENCH=0 bash results/attention/gluon_backward/own_waits/call.sh
