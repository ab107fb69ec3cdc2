"""
Tests of profile_baseline.py (CPU, --tiny).

* a profile run writes the Chrome trace, the TensorBoard trace and summary.json,
  and prints the top-operations table and the category summary;
* a run with the custom kernels finds them (in the RMSNorm and cross-entropy
  categories) and prints the change against the saved baseline summary;
* the classification by name, and the GPU attribution of kernels to operators,
  checked on hand-made profiler events (the GPU path cannot run on a CPU);
* outputs: --trace-dir is checked before the work, and a new profile replaces
  the previous one only when it is complete (a failed run, here out of CPU
  memory, leaves the old one as it was); summary.json is strict JSON.

Usage:
    python -m pytest tests/profile_test.py -v
    python tests/profile_test.py
"""

if __name__ == "__main__":
    # `python tests/profile_test.py`: pytest runs this file. Its imports below need the
    # repository root on the path, which the root's conftest.py gives pytest.
    import sys

    import pytest

    raise SystemExit(pytest.main([__file__, *sys.argv[1:]]))


import contextlib
import glob
import io
import json
import os
import sys
from collections import namedtuple
from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType

import profile_baseline as pb
from kernel_ft import models

TINY = ["--tiny", "--dataset", "synthetic", "--batch-size", "2", "--seq-len", "32"]


@pytest.fixture(scope="module")
def profiles(tmp_path_factory):
    """The plain baseline, then both custom kernels, into one trace directory."""
    trace_dir = tmp_path_factory.mktemp("traces")
    outputs = {}
    for name, argv in (("baseline", []), ("custom-rmsnorm-ce", ["--use-custom-rmsnorm", "--use-custom-ce"])):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            summary = pb.main(TINY + argv + ["--trace-dir", str(trace_dir)])
        outputs[name] = (summary, buf.getvalue())
    return trace_dir, outputs


def test_traces_written(profiles):
    trace_dir, _ = profiles
    for name in ("baseline", "custom-rmsnorm-ce"):
        with open(trace_dir / name / "trace.json") as f:
            trace = json.load(f)
        assert len(trace["traceEvents"]) > 100
        assert len(glob.glob(str(trace_dir / name / "tensorboard" / "*.pt.trace.json"))) == 1
        with open(trace_dir / name / "summary.json") as f:
            summary = json.load(f)
        assert set(summary["categories"]) == set(pb.CATEGORY_NAMES)
        assert abs(sum(c["share"] for c in summary["categories"].values()) - 1.0) < 1e-6


def test_table_and_summary_printed(profiles):
    _, outputs = profiles
    summary, out = outputs["baseline"]
    kind = "self device time" if torch.cuda.is_available() else "self CPU time"
    assert f"Top 20 operations by {kind}" in out
    assert f"Summary by category ({kind}, per step)" in out
    for category in pb.CATEGORY_NAMES:
        assert f"\n{category} " in out, category
    assert "Peak memory:" in out
    table = out.split("Top 20 operations")[1].split("Summary by category")[0]
    rows = table.split("-" * 96 + "\n")[1].strip().split("\n=")[0].splitlines()
    assert len(rows) == 20
    # Noise rows are filtered out of the table.
    for noise in ("ProfilerStep", "autograd::engine", "Optimizer.step", "[memory]"):
        assert noise not in table
    assert not any(line.split()[0] in pb.PHASES for line in rows)
    # The baseline's work is where we expect it.
    cats = summary["categories"]
    assert cats["matrix multiply"]["share"] > 0.05
    assert cats["cross-entropy/softmax"]["calls_per_step"] > 0 and cats["RMSNorm"]["calls_per_step"] > 0
    assert cats["optimizer"]["share"] > 0
    if torch.cuda.is_available():
        return  # on a GPU the rows are kernels; the operator-level checks below are for the CPU profile
    # PyTorch's RMSNorm, multiplies included, forward and backward, counts as RMSNorm;
    # the MLP's multiplies do not.
    ops = {(op["name"], op["category"]): op["calls_per_step"] for op in summary["ops"]}
    for name in ("aten::pow", "aten::mean", "aten::rsqrt", "aten::mul"):
        assert (name, "RMSNorm") in ops, name
    assert ops[("aten::mul", "RMSNorm")] > 5 * 2  # 5 norms x 2 multiplies, plus backward
    assert ("aten::mul", "other elementwise") in ops
    assert ("aten::_log_softmax", "cross-entropy/softmax") in ops


def test_custom_kernels_show_up(profiles):
    _, outputs = profiles
    summary, out = outputs["custom-rmsnorm-ce"]
    ops = {(op["name"], op["category"]) for op in summary["ops"]}
    if torch.cuda.is_available():  # GPU rows are kernels: ours by their Triton names
        assert ("_rmsnorm_fwd_kernel", "RMSNorm") in ops and ("_rmsnorm_bwd_kernel", "RMSNorm") in ops
        assert ("_cross_entropy_fwd_kernel", "cross-entropy/softmax") in ops
    else:
        assert ("TritonRMSNormFunction", "RMSNorm") in ops
        assert ("TritonRMSNormFunctionBackward", "RMSNorm") in ops
        assert ("TritonCrossEntropyFunction", "cross-entropy/softmax") in ops
    # HF's log-softmax is gone, and so is the eager RMSNorm's pow.
    names = {op["name"] for op in summary["ops"]}
    assert "aten::_log_softmax" not in names and "aten::pow" not in names
    assert "Change per category: baseline -> custom-rmsnorm-ce" in out
    assert "replaced 5 RMSNorm modules" in out


def test_out_of_memory(monkeypatch, tmp_path):
    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.91 GiB")

    monkeypatch.setattr(pb.training, "train_step", oom)
    with pytest.raises(SystemExit) as e:
        pb.main(TINY + ["--trace-dir", str(tmp_path)])
    assert "out of GPU memory while profiling the tiny LLaMA with batch 2 x seq 32" in str(e.value.code)
    assert os.listdir(tmp_path) == []  # the unfinished profile left nothing behind


# --------------------------------------------------------------------------------
# Outputs: checked first; a new profile replaces the old one only when complete
# --------------------------------------------------------------------------------
def test_fp8_refused_before_the_model_where_there_are_no_fp8_tensor_cores(monkeypatch, tmp_path):
    monkeypatch.setattr(models, "load_model", lambda *a: pytest.fail("built a model before the check"))
    monkeypatch.setattr(pb.flags.swap_common, "fp8_supported", lambda device: (False, "no FP8 tensor cores here"))
    with pytest.raises(SystemExit) as e:
        pb.main(TINY + ["--fp8", "tensorwise", "--trace-dir", str(tmp_path)])
    assert str(e.value.code) == "error: --fp8: no FP8 tensor cores here"


def test_bad_trace_dir_fails_before_profiling(tmp_path, monkeypatch):
    monkeypatch.setattr(models, "load_model", lambda *a: pytest.fail("built a model before the check"))
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    with pytest.raises(SystemExit) as e:
        pb.main(TINY + ["--trace-dir", str(not_a_dir)])
    msg = str(e.value.code)
    assert msg == f"error: --trace-dir {not_a_dir}: exists and is not a directory"


def test_rerun_keeps_the_old_profile_until_the_new_one_is_complete(tmp_path, monkeypatch):
    argv = ["--tiny", "--dataset", "synthetic", "--batch-size", "1", "--seq-len", "16", "--trace-dir", str(tmp_path)]
    with contextlib.redirect_stdout(io.StringIO()):
        pb.main(argv)
    out_dir = tmp_path / "baseline"
    old = {name: (out_dir / name).read_bytes() for name in ("trace.json", "summary.json")}
    json.loads(old["summary.json"], parse_constant=lambda c: pytest.fail(f"bare {c}"))  # strict JSON

    # A second run fails inside the profiled step, out of CPU memory: while it
    # runs and after it failed, the first profile is there, whole.
    real_step = pb.training.train_step
    calls = []

    def fail_in_profiled_step(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # after the warm-up step
            assert {name: (out_dir / name).read_bytes() for name in old} == old
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8589934592 bytes")
        return real_step(*args, **kwargs)

    monkeypatch.setattr(pb.training, "train_step", fail_in_profiled_step)
    with pytest.raises(SystemExit) as e, contextlib.redirect_stdout(io.StringIO()):
        pb.main(argv)
    assert "out of CPU memory while profiling the tiny LLaMA with batch 1 x seq 16" in str(e.value.code)
    assert {name: (out_dir / name).read_bytes() for name in old} == old
    assert sorted(os.listdir(tmp_path)) == ["baseline"]  # no half-written profile beside it

    # A third run completes: it replaces the first profile, whole.
    monkeypatch.setattr(pb.training, "train_step", real_step)
    with contextlib.redirect_stdout(io.StringIO()):
        pb.main(argv)
    assert sorted(os.listdir(tmp_path)) == ["baseline"]
    assert (out_dir / "trace.json").read_bytes() != old["trace.json"]
    assert len(os.listdir(out_dir / "tensorboard")) == 1


def test_profile_names():
    def name(*argv):
        return pb.profile_name(pb.parse_args(list(argv)))

    assert name() == "baseline"
    assert name("--use-custom-rmsnorm") == "custom-rmsnorm"
    assert name("--use-custom-ce") == "custom-ce"
    assert name("--use-custom-rmsnorm", "--use-custom-ce") == "custom-rmsnorm-ce"
    assert name("--no-pin-memory") == "baseline-pageable"
    assert name("--use-custom-rmsnorm", "--fp8", "rowwise") == "custom-rmsnorm-fp8"
    assert name("--fp8", "tensorwise", "--fp8-grads", "e5m2") == "custom-fp8-e5m2"
    assert name("--use-custom-rmsnorm", "--compile", "--no-pin-memory") == "custom-rmsnorm-compiled-pageable"


@pytest.mark.parametrize(
    "name, category",
    [
        ("aten::mm", "matrix multiply"),
        ("aten::addmm", "matrix multiply"),
        ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", "matrix multiply"),
        ("aten::_flash_attention_forward", "attention"),
        ("aten::_scaled_dot_product_efficient_attention_backward", "attention"),
        ("_attn_bwd_dkdv_kernel", "attention"),
        ("_attn_fwd_kernel", "attention"),
        ("aten::pow", "RMSNorm"),
        ("aten::rsqrt", "RMSNorm"),
        ("_rmsnorm_fwd_kernel", "RMSNorm"),
        ("_rmsnorm_dw_reduce_kernel", "RMSNorm"),
        ("aten::_log_softmax", "cross-entropy/softmax"),
        ("aten::nll_loss_forward", "cross-entropy/softmax"),
        ("_cross_entropy_fwd_kernel", "cross-entropy/softmax"),
        ("aten::_fused_adamw_", "optimizer"),
        ("aten::copy_", "memory copies"),
        ("aten::_to_copy", "memory copies"),
        ("aten::mul", "other elementwise"),
        ("aten::silu_backward", "SwiGLU (silu * up)"),
        ("_swiglu_bwd_kernel", "SwiGLU (silu * up)"),
        ("_rope_fwd_kernel", "RoPE"),
        ("_amax_kernel", "FP8 casts"),
        ("_amax_flat_kernel", "FP8 casts"),
        ("_cast_kernel", "FP8 casts"),
        ("aten::_scaled_mm", "matrix multiply"),
        ("TritonRoPEFunctionBackward", "RoPE"),
        ("aten::embedding_dense_backward", "other"),
    ],
)
def test_category_of_name(name, category):
    assert pb.category_of_name(name) == category


# --------------------------------------------------------------------------------
# The GPU path on hand-made events: every microsecond of device time counted once
# --------------------------------------------------------------------------------
Kernel = namedtuple("Kernel", ["name", "device", "duration"])


def _cpu(name, parent=None, kernels=(), annotation=False, seq=-1):
    return SimpleNamespace(name=name, device_type=DeviceType.CPU, cpu_parent=parent, sequence_nr=seq,
                           kernels=[Kernel(k, 0, us) for k, us in kernels], is_user_annotation=annotation)


def _gpu(name, us, annotation=False):
    span = SimpleNamespace(elapsed_us=lambda: us)
    return SimpleNamespace(name=name, device_type=DeviceType.CUDA, cpu_parent=None, kernels=[], sequence_nr=-1,
                           is_user_annotation=annotation, time_range=span)


def test_gpu_rows_attribution():
    step = _cpu("ProfilerStep*", annotation=True)
    fwd = _cpu("forward", step, annotation=True)
    opt = _cpu("optimizer", step, annotation=True)
    node = _cpu("autograd::engine::evaluate_function: PowBackward0", step)
    norm = _cpu("category: RMSNorm", fwd, annotation=True)
    norm_mul = _cpu("aten::mul", norm, [("void at::native::vectorized_elementwise_kernel<4>(int)", 4.0)], seq=7)
    norm_mul_bwd = _cpu("autograd::engine::evaluate_function: MulBackward0", step, seq=7)
    adam = _cpu("aten::_fused_adamw_", opt, [("void at::native::fused_adam_kernel<>(...)", 20.0)])
    launch = _cpu("cudaLaunchKernel", adam)
    # Seen on an H200 at 2 x 2048: the runtime's "Command Buffer Full" marker lists
    # kernels it waited behind, the same kernel objects many times over.
    buffer_full = SimpleNamespace(name="Command Buffer Full", device_type=DeviceType.CPU, cpu_parent=launch,
                                  sequence_nr=-1, kernels=adam.kernels * 3, is_user_annotation=False)
    events = [
        step, fwd, opt, node, norm, norm_mul, norm_mul_bwd,
        _cpu("aten::mul", norm_mul_bwd, [("void at::native::vectorized_elementwise_kernel<4>(int)", 6.0)]),
        _cpu("aten::mm", fwd, [("sm90_xmma_gemm_bf16", 100.0)]),
        _cpu("TritonRMSNormFunction", fwd, [("_rmsnorm_fwd_kernel", 10.0)]),
        _cpu("aten::mul", node, [("void at::native::vectorized_elementwise_kernel<4>(int)", 5.0)]),
        _cpu("aten::mul", fwd, [("void at::native::vectorized_elementwise_kernel<4>(int)", 3.0)]),
        adam,
        launch,
        buffer_full,
        _cpu("cudaLaunchKernel", fwd),
        # Device side: the kernels above, an input copy no operator claimed, and
        # the GPU copy of a user annotation, which is not work.
        _gpu("sm90_xmma_gemm_bf16", 100.0),
        _gpu("_rmsnorm_fwd_kernel", 10.0),
        _gpu("void at::native::vectorized_elementwise_kernel<4>(int)", 18.0),
        _gpu("void at::native::fused_adam_kernel<>(...)", 20.0),
        _gpu("Memcpy HtoD (Pageable -> Device)", 2.0),
        _gpu("forward", 500.0, annotation=True),
    ]
    rows = pb.gpu_rows(events)
    assert rows[("aten::mm", "matrix multiply")] == [100.0, 1]
    assert rows[("_rmsnorm_fwd_kernel", "RMSNorm")] == [10.0, 1]
    # RMSNorm's multiplies: inside its range (4), in the backward of an operator of
    # that range (6, found by sequence number), inside PowBackward0 (5).
    assert rows[("aten::mul", "RMSNorm")] == [15.0, 3]
    assert rows[("aten::mul", "other elementwise")] == [3.0, 1]
    assert rows[("aten::_fused_adamw_", "optimizer")] == [20.0, 1]
    assert rows[("Memcpy HtoD", "memory copies")] == [2.0, 1]
    assert sum(us for us, _ in rows.values()) == 150.0  # all device work, once, without the annotation
    total_ms, categories, ops = pb.summarize(rows, steps=1)
    assert abs(total_ms - 0.150) < 1e-9
    assert abs(categories["RMSNorm"]["share"] - 25 / 150) < 1e-9


def test_fsdp_buffer_copies_count_as_communication():
    """FSDP2's copy into its all-gather buffer is an aten::_foreach_copy_, a name the
    optimizer's foreach ops share; inside FSDP's range it is communication."""
    hook = _cpu("FSDP::all_gather_copy_in")
    copy_in = _cpu("aten::_foreach_copy_", hook, [("void at::native::multi_tensor_apply_kernel<>(...)", 7.0)])
    gather = _cpu("c10d::_allgather_base_", None, [("ncclDevKernel_AllGather_RING_LL(...)", 50.0)])
    step = _cpu("optimizer", annotation=True)
    adam = _cpu("aten::_foreach_mul_", step, [("void at::native::multi_tensor_apply_kernel<>(...)", 3.0)])
    rows = pb.gpu_rows([hook, copy_in, gather, step, adam])
    assert rows[("aten::_foreach_copy_", "communication")] == [7.0, 1]
    assert rows[("ncclDevKernel_AllGather_RING_LL", "communication")] == [50.0, 1]  # named after the kernel
    assert rows[("aten::_foreach_mul_", "optimizer")] == [3.0, 1]


def test_host_to_device_copies_by_kind_of_host_memory():
    """Pageable and pinned copies counted apart, per step, with the host time of the
    runtime's copy calls against all CUDA API time."""
    def api(name, us):
        return SimpleNamespace(name=name, device_type=DeviceType.CPU, self_cpu_time_total=us)

    events = [
        _gpu("Memcpy HtoD (Pageable -> Device)", 30.0),
        _gpu("Memcpy HtoD (Pageable -> Device)", 10.0),
        _gpu("Memcpy HtoD (Pinned -> Device)", 4.0),
        _gpu("Memcpy DtoH (Device -> Pageable)", 99.0),  # not host-to-device
        _gpu("sm90_xmma_gemm_bf16", 100.0),
        api("cudaMemcpyAsync", 600.0),
        api("cudaLaunchKernel", 300.0),
        api("cudaStreamSynchronize", 100.0),
        api("aten::copy_", 50.0),  # an operator, not a CUDA API call
    ]
    h2d = pb.host_to_device(events, steps=2)
    assert h2d["pageable"] == {"copies": 1.0, "device_ms": 0.020}
    assert h2d["pinned"] == {"copies": 0.5, "device_ms": 0.002}
    assert h2d["copy_api_ms"] == 0.3 and h2d["cuda_api_ms"] == 0.5


def test_pin_memory_flag_reaches_the_data_loader():
    """--no-pin-memory turns pinning off; on a CPU nothing is pinned either way."""
    args = pb.parse_args(["--no-pin-memory"])
    assert args.pin_memory is False and pb.parse_args([]).pin_memory is True
    args.num_workers = 0
    assert pb.dataloader.loader([], range(0), args).pin_memory is False
    args.pin_memory = True
    assert pb.dataloader.loader([], range(0), args).pin_memory is torch.cuda.is_available()

