#!/bin/bash
# H100, Triton 3.9.0 + its ptxas 13.4: key/value heads side by side (kv_group) with own_waits and regalloc_default on.
VARIANTS="default=own_waits:1,regalloc_default:1 kv2=own_waits:1,regalloc_default:1,kv_group:2 kv4=own_waits:1,regalloc_default:1,kv_group:4 kv8=own_waits:1,regalloc_default:1,kv_group:8" SWEEP_S=200 BENCH=0 bash results/attention/gluon_backward/own_waits/call.sh
