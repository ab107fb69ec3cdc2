#!/bin/bash
# On an H100 (Triton 3.8+ carried), from the checkout with ptxas_sm90.patch applied: the Gluon backward with the
# two changes found offline (probe.txt), each alone and both, checked against float64 and timed beside the Triton
# backward and cuDNN; then the fastest made the default in this copy, benchmark_kernels attention and the Hopper
# tests run with it (BENCH=0: without the benchmark, as h100/ ran it). Records the ptxas versions Triton is pointed at.
bash results/attention/gluon_backward/variants_call.sh ptxas_sm90 default= distinct=distinct_acc:1 \
  regalloc=regalloc_default:1 both=distinct_acc:1,regalloc_default:1
