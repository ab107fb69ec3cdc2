"""
What every kernel lesson shares: read this file first, then any *_kernel.py.

Each kernel file (rmsnorm, cross_entropy, linear_cross_entropy, swiglu, rope,
adamw) imports its common ground from here and nothing private from the others:

* ``INTERPRET``: the one switch that runs Triton kernels on a laptop. Without a
  GPU we set ``TRITON_INTERPRET=1`` before ``triton`` is imported; Triton's
  interpreter then executes each kernel program with NumPy on CPU tensors
  (correct, slow, good for learning and for CI). Its fixed cost per call is cut
  by one shortcut (``_swap_builtins_once``: the same swaps of triton.language).
* A version check: the interpreter of each Triton release has its own quirks;
  a combination we know to fail stops here with one line that says what to
  install, instead of a traceback from inside the interpreter.
* ``SUPPORTED_DTYPES`` and ``check_kernel_device``: the input checks every
  launcher does first.
* ``cast_to``, ``exp``, ``log``: the @triton.jit helpers for rounding to the
  output dtype and for exponentials, each with the same result on GPU and CPU.
* ``as_rows``, ``num_sms``: viewing [..., H] as rows, sizing persistent grids.
* ``kernel_op``: registering a launcher as a PyTorch custom operator, so that
  ``torch.compile`` can put our kernels inside its graphs.
* ``amax_slots``, ``note_amax``, ``take_amax``: a kernel that produces an FP8
  layer's input hands its max |x| to the cast, and the optimizer its weight's
  (``weight_amax_slots``, ...; Step 22). ``extent_key`` names the tensor handed
  over (RMSNorm's outputs made again in backward use it too).

What the kernels' model patching shares (finding a model's parts, probing it,
replacing a module or one module's forward) is in swap_common.py.

Nothing runs on import except the interpreter switch (with its shortcut, below) and the
version check.
"""

import functools
import inspect
import os
import sys

import torch

if not torch.cuda.is_available():
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        # Triton builds its own helpers (the combine functions of tl.sum, tl.max)
        # when it is imported; imported without the interpreter they cannot run on
        # CPU tensors, and the failure would surface deep inside the first launch.
        raise ImportError(
            "triton was imported before the kernels on a machine without a GPU: import the "
            "*_kernel modules (or kernel_common) before anything that imports triton "
            "(transformers, torch._dynamo), or set TRITON_INTERPRET=1 in the environment"
        )
    # No GPU: run the kernels through Triton's interpreter on CPU tensors. This
    # must happen before triton is imported (just below).
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Triton reads the variable when it is imported; so do we, once.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

import numpy  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton import knobs  # noqa: E402
from triton.language.extra import libdevice  # noqa: E402

MIN_TRITON = (3, 6)


def _version(text):
    """'3.6.0+git...' -> (3, 6)."""
    parts = []
    for piece in text.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def check_versions(triton_version=triton.__version__, numpy_version=numpy.__version__, interpret=INTERPRET):
    """Refuse the Triton / NumPy combinations known to fail, with what to install."""
    if _version(triton_version) < MIN_TRITON:
        raise ImportError(
            f"triton {triton_version} is too old for these kernels: install triton>=3.6 "
            f"(pip install -r requirements.txt)"
        )
    if interpret and _version(triton_version) < (3, 7) and _version(numpy_version) >= (2, 4):
        # Triton 3.6's interpreter turns 1-element arrays into Python ints with an
        # API that NumPy 2.4 removed: every kernel with a runtime loop bound fails.
        raise ImportError(
            f"triton {triton_version}'s CPU interpreter does not work with numpy {numpy_version}: "
            f"pip install 'numpy<2.4' (or triton>=3.9)"
        )


try:
    check_versions()
except ImportError as e:  # one line for the user, not a traceback through the imports
    raise SystemExit(f"error: {e}") from None


# The interpreter's fixed cost per call. Before each launch Triton's interpreter
# swaps its NumPy versions in for triton.language's builtins (``_patch_lang``,
# undone when the launch ends), and it does it again at every call of a
# @triton.jit helper inside a program, where they are swapped already. To find
# them it lists every member of tl, tl.core, tl.tensor and tl.math
# (inspect.getmembers: a few hundred names each, sorted) and scans the calling
# function's module globals. A tiny model's training step calls helpers ~15,000
# times, and that was a third of its interpreter time (cProfile; NOTES "The CPU
# suite in the interpreter"). Two shortcuts, the same swaps:
# * the builtins of each module are listed once (they are the same objects at
#   every call); each call still swaps exactly those not swapped yet, as
#   Triton's loop does;
# * a helper called inside a launch whose language modules are swapped already
#   (by the launch, or by an earlier helper of it) swaps nothing: Triton's call
#   would only set the same functions again.
# Interpreter only: on a GPU nothing here runs.
FAST_INTERPRETER_TRITON = ((3, 6), (3, 9))  # releases whose interpreter.py was read for this (3.6, 3.7, 3.8, 3.9)


class _SwappedAlready:
    """What a helper's call inside a launch gets instead of a scope: nothing to undo."""

    def restore(self):
        pass


def _swap_builtins_once(interpreter):
    listed = {}  # module or class -> [(name, builtin)]
    languages = {}  # a jit function's Python function -> the language modules its globals hold (by id)
    launch = []  # while a launch runs: the language modules it swapped

    def patch_builtin(pkg, builder, scope):
        builtins = listed.get(pkg)
        if builtins is None:
            builtins = listed[pkg] = [(name, member) for name, member in inspect.getmembers(pkg)
                                      if tl.core.is_builtin(member)]
        for name, member in builtins:
            if getattr(pkg, name, None) is member:  # not swapped yet
                interpreter._patch_attr(pkg, name, member, builder, scope)

    triton_patch_lang = interpreter._patch_lang

    def patch_lang(fn):
        seen = languages.get(fn)
        if seen is None:
            seen = languages[fn] = frozenset(
                id(value) for value in fn.__globals__.values() if inspect.ismodule(value) and value in (tl, tl.core))
        if launch and seen and seen <= launch[0]:
            return _SwappedAlready()
        scope = triton_patch_lang(fn)
        if launch:  # a helper that sees another module (Triton's own tl.sum sees tl.core): swapped now too
            launch[0] |= seen
        else:  # a launch starts; it undoes its scope when it ends
            launch.append(seen)
            undo = scope.restore

            def restore():
                launch.clear()
                undo()

            scope.restore = restore
        return scope

    interpreter._patch_builtin = patch_builtin
    interpreter._patch_lang = patch_lang


if INTERPRET:
    from triton.runtime import interpreter as _interpreter  # noqa: E402

    if FAST_INTERPRETER_TRITON[0] <= _version(triton.__version__) <= FAST_INTERPRETER_TRITON[1] \
            and all(hasattr(_interpreter, name) for name in ("_patch_lang", "_patch_builtin", "_patch_attr")):
        _swap_builtins_once(_interpreter)

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Inside @triton.jit code a module-level name must be a tl.constexpr; this one
# lets the kernels choose interpreter-only code paths at compile time, without a
# flag in every kernel signature.
IN_INTERPRETER = tl.constexpr(INTERPRET)
LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): exp(t) == exp2(t * LOG2E)


# --------------------------------------------------------------------------------
# Rounding to the output dtype
# --------------------------------------------------------------------------------
# GPUs round float32 -> bfloat16 to nearest-even. Triton's CPU interpreter
# truncates instead, which would make CPU results 2-3x less accurate than the GPU's
# and than PyTorch's. In the interpreter we round by hand: add half an ulp of bf16
# (plus the tie-breaking bit) to the float32 bits and clear the low 16 bits; the
# cast that follows is then exact. On the GPU this is a plain hardware cast.
@triton.jit
def cast_to(x, dtype: tl.constexpr):
    if IN_INTERPRETER and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


# --------------------------------------------------------------------------------
# exp and log, fast or precise
# --------------------------------------------------------------------------------
# The fast exp (bf16/fp16 inputs) is exp2(t * log2 e): one multiply and the GPU's
# ex2.approx instruction, ~2 ulp of float32, far below bf16's resolution. Float32
# inputs deserve a float32-accurate exp, as PyTorch's expf is: libdevice's exp on
# the GPU. The CPU interpreter has no libdevice, and its tl.exp / tl.log are
# NumPy's float32 SIMD approximations (up to ~3 ulp, measurably worse than
# PyTorch's CPU kernels); there we evaluate in float64 and round once, which is
# what the GPU's accurate functions come close to.
@triton.jit
def exp(t, PRECISE: tl.constexpr):
    if PRECISE:
        if IN_INTERPRETER:
            return tl.exp(t.to(tl.float64)).to(tl.float32)
        else:
            return libdevice.exp(t)
    else:
        return tl.exp2(t * LOG2E)


@triton.jit
def tanh(t, PRECISE: tl.constexpr):
    # PRECISE: float32-accurate, libdevice's on the GPU, float64 in the interpreter.
    # Otherwise 2 sigmoid(2t) - 1: one exp, saturating cleanly to +-1, with an
    # absolute error of a float32 rounding (ample for 16-bit inputs).
    if PRECISE:
        if IN_INTERPRETER:
            x = t.to(tl.float64)
            return (2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0).to(tl.float32)
        else:
            return libdevice.tanh(t)
    else:
        return 2.0 / (1.0 + tl.exp2(t * (-2.0 * LOG2E))) - 1.0  # the tensor first: Triton 3.9's interpreter


@triton.jit
def log(t):
    # Always the accurate one: the kernels take one log per row, not per element.
    if IN_INTERPRETER:
        return tl.log(t.to(tl.float64)).to(tl.float32)
    else:
        return libdevice.log(t)


# --------------------------------------------------------------------------------
# Autograd: first derivatives only
# --------------------------------------------------------------------------------
def first_order_only(op):
    """Decorator for a ``backward`` whose kernels compute first derivatives only.

    Under ``create_graph=True`` (gradient penalties, Hessian-vector products)
    autograd runs backward with grad mode on and would record our result as a
    constant: the second-order term would be silently missing. Refuse instead.
    Without create_graph autograd runs backward with grad mode off, so past this
    check nothing is recorded: ``@once_differentiable`` (which wraps every
    backward in no_grad and its outputs in checks, ~2 us of host time) would
    only repeat it.
    """
    def decorate(backward):
        @functools.wraps(backward)
        def checked(ctx, *grads):
            if torch.is_grad_enabled():
                raise RuntimeError(
                    f"{op}: create_graph=True (a second derivative) is not supported by the fused kernel; "
                    f"use the PyTorch formulation for higher-order gradients"
                )
            return backward(ctx, *grads)
        return checked
    return decorate


# --------------------------------------------------------------------------------
# Host-side helpers of the launchers
# --------------------------------------------------------------------------------
def check_kernel_device(*tensors):
    """All tensors on one device that Triton can run on; a clear error otherwise."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on the same device, got {sorted(str(d) for d in devices)}")
    device = tensors[0].device
    if device.type == "cpu" and not INTERPRET:
        raise RuntimeError(
            "CPU tensors need the Triton interpreter: set TRITON_INTERPRET=1 before "
            "triton is imported, or move the tensors to a CUDA device"
        )
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {device}; use CUDA (or CPU with TRITON_INTERPRET=1)")


def as_rows(t, n_cols):
    """View [..., n_cols] as [rows, n_cols] with contiguous columns (copy only if needed)."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t.reshape(-1, n_cols)


# Grid arithmetic on the host. triton.cdiv and triton.next_power_of_2 also work
# inside kernels, and that generality costs ~1.5 us of host time per call (they
# unwrap compile-time constants first); a launch does several. Plain integers:
def cdiv(a, b):
    """ceil(a / b) for positive integers."""
    return -(-a // b)


def next_power_of_2(n):
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def interpreter_block(n, pieces, smallest, largest=2**20):
    """A block for ``n`` elements in the interpreter, where every program and every loop
    trip costs a fixed Python overhead: the power of two that cuts them into about ``pieces``
    blocks (a grid of two programs: 2; a strided loop of P programs, two to four trips
    each: 4 P), never under ``smallest`` (a power of two: a small test tensor still spans
    several blocks) nor over ``largest``."""
    return min(largest, max(smallest, next_power_of_2(cdiv(n, pieces))))


_SM_COUNT = {}


def num_sms(device):
    """Streaming multiprocessors of ``device`` (persistent grids launch a few per SM)."""
    if device.type != "cuda":
        return 4  # the interpreter runs programs one by one; a few is plenty
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


# --------------------------------------------------------------------------------
# Launching with less host time
# --------------------------------------------------------------------------------
# ``kernel[grid](*args)`` is Triton's launch, and on every call its Python does
# the same work: read the runtime settings, classify every argument (dtype,
# 16-byte alignment of pointers, integers equal to 1 or divisible by 16: the
# "specialization" a compiled kernel is built for), turn that into a cache key
# (str() of the options), look the kernel up, check the globals it uses, build
# the launch-hook metadata and call the C launcher. On a GPU server's host that
# is ~22 us per launch, for kernels whose GPU time at 4,096 rows is ~30 us: the
# eager RMSNorm is host-bound (Step 17 measures it).
#
# ``@fast_launch`` keeps the syntax and Triton's own classification (its
# per-kernel "binder", the same function Triton calls, so a kernel is reused only
# for arguments Triton would reuse it for) and skips the rest: the first call of
# each specialization goes through ``kernel[grid]`` (compiling, checking), and
# the CompiledKernel it returns is kept under the specialization; later calls
# hand the arguments straight to its C launcher. That halves the host time per
# launch (~10 us). The shortcut steps aside (plain ``kernel[grid]``) in the CPU
# interpreter, while a tool has launch hooks installed (Triton's profiler,
# Proton), for Triton versions whose launch internals it was not checked
# against, and when LLAMA_KERNELS_PLAIN_LAUNCH=1. Runtime settings (TRITON_DEBUG)
# are read when a specialization is first launched.
#
# Every launch, fast or plain, also asks for floating-point contraction (a * b + c
# as one fused multiply-add): Triton's default through 3.9, which warns that 3.10
# turns it off unless a launch asks. Every measurement here and every bit-for-bit
# comparison (the FP8 casts against PyTorch's) ran with it, so it is not left to
# the installed version. The interpreter ignores the option.
LAUNCH_OPTIONS = {"enable_fp_fusion": True}
FAST_LAUNCH_TRITON = ((3, 6), (3, 9))  # 3.6 tested on GPUs; 3.9's launch code read, the same calls
FAST_LAUNCH = (
    not INTERPRET
    and FAST_LAUNCH_TRITON[0] <= _version(triton.__version__) <= FAST_LAUNCH_TRITON[1]
    and os.environ.get("LLAMA_KERNELS_PLAIN_LAUNCH", "0") != "1"
)


def _launch_hooks_idle():
    """No launch hook and no compiler-stage hook is installed (then Triton's full path runs)."""
    runtime = knobs.runtime
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):  # a HookChain with entries, or a function
            return False
    return getattr(runtime, "add_stages_inspection_hook", None) is None


def _with_launch_options(launcher, *args, **kwargs):
    return launcher(*args, **{**LAUNCH_OPTIONS, **kwargs})


class fast_launch:  # noqa: N801 -- used as a decorator, like triton.jit
    """Decorator above ``@triton.jit``: ``kernel[grid](*args, **kwargs)`` as before, less host time.

    ``kernel.fn`` is the JIT function itself; ``kernel.compiled`` maps
    (device, specialization, options) to the CompiledKernel launched for them.
    """

    def __init__(self, fn):
        self.fn = fn
        self.compiled = {}
        functools.update_wrapper(self, fn.fn if hasattr(fn, "fn") else fn)

    def __getitem__(self, grid):
        if not FAST_LAUNCH or callable(grid):  # a grid computed from the arguments: Triton's path
            return functools.partial(_with_launch_options, self.fn[grid])
        return functools.partial(_with_launch_options, functools.partial(self._launch, grid))

    def _launch(self, grid, *args, **kwargs):
        device = torch.cuda.current_device()  # as Triton: the current device, not the tensors'
        caches = self.fn.device_caches.get(device)  # filled by the first plain launch on it
        key = None
        if caches is not None and _launch_hooks_idle():
            bound, specialization, options = caches[4](*args, **kwargs)  # Triton's binder
            key = (device, tuple(specialization), tuple(options.items()))
            kernel = self.compiled.get(key)
            if kernel is not None:
                n = len(grid)
                kernel.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1,
                           torch._C._cuda_getCurrentRawStream(device), kernel.function,
                           kernel.packed_metadata, None, None, None, *bound.values())
                return kernel
        kernel = self.fn[grid](*args, **kwargs)  # Triton's full path: compiles, checks, launches
        if key is not None:
            self.compiled[key] = kernel
        return kernel


# --------------------------------------------------------------------------------
# Custom operators: our kernels inside torch.compile graphs
# --------------------------------------------------------------------------------
# torch.compile traces Python into a graph of PyTorch operators, running the code
# on "fake" tensors that have shapes and dtypes but no data. A Triton launch is
# not a PyTorch operator, and it cannot run on fake tensors, so the tracer stops
# there ("graph break") or fails. A custom operator fixes both: PyTorch treats
# ``torch.ops.llama_kernels.<name>`` as one opaque node of the graph, runs the
# launcher when the graph runs, and asks the registered *fake* function for the
# output shapes while tracing.
#
# The price of an operator is the dispatcher: every call passes through PyTorch's
# C++ dispatch and back into Python, some microseconds of host time per launch
# that an eager training step (hundreds of launches) would pay for nothing. So
# the launchers keep their plain Python calls in eager mode and take the operator
# only while torch.compile traces (``torch.compiler.is_compiling()``); the traced
# graph then holds the operator and replays it without any of this Python.
LIBRARY = "llama_kernels"


def kernel_op(name, fake):
    """Decorator: register a launcher as ``torch.ops.llama_kernels.<name>``.

    The launcher needs type annotations (PyTorch derives the operator's schema
    from them) and must return new tensors only (an output may not alias an
    input). ``fake`` takes the same arguments and returns empty tensors of the
    outputs' shapes, dtypes and layouts. The returned function calls the
    launcher directly in eager mode and the operator under torch.compile (or
    any tracer: its first argument that is not None, a tensor, tells); the
    operator itself is its ``.op`` attribute.
    """
    def register(launcher):
        op = torch.library.custom_op(f"{LIBRARY}::{name}", launcher, mutates_args=())
        op.register_fake(fake)

        @functools.wraps(launcher)
        def launch(*args):
            if torch.compiler.is_compiling() or traced(next(a for a in args if a is not None)):
                return op(*args)
            return launcher(*args)

        launch.op = op
        return launch
    return register


def traced(t):
    """Whether ``t`` is a tracer's stand-in (fake or functional tensor), as when
    torch.compile differentiates a graph, or torch.func / make_fx trace one
    without Dynamo (then ``is_compiling()`` is False). Real inputs are plain
    tensors or Parameters."""
    return type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter


def nothing(like):
    """The placeholder for an output that was not asked for (an operator cannot return None)."""
    return like.new_empty(0)


# --------------------------------------------------------------------------------
# FP8 producers: the amax of an output, handed to the cast that reads it (Step 22)
# --------------------------------------------------------------------------------
# A per-tensor FP8 cast needs the largest |x| before it can cast the first element:
# on its own it reads x twice (fp8_kernel.py). The kernel that *makes* x (RMSNorm,
# SwiGLU, SwiGLU's backward) has every element in registers anyway, so it folds
# max |x| into a few float32 slots as it stores x (tl.atomic_max, one per program),
# and the cast reads x once. The hand-over happens on the host: the producer notes
# (x, slots) here, ``quantize`` takes the slots back for the same x. Exact, not an
# estimate: the producer takes the maximum of the values it stores, rounded to x's
# dtype, so the scale and every fp8 bit are those of the two-pass cast.
#
# Rules that keep it safe:
# * Eager code and CUDA-graph captures only (the producer and the cast run in the
#   same forward or backward, hence in the same replay). Never under a tracer
#   (torch.compile): there an output buffer may be reused by generated kernels that
#   do not bump version counters, so nothing is noted and every cast measures.
# * The entry is keyed on x's storage (a weak reference: a later tensor can never
#   take the same key), its place in it and its version counter: a view of other
#   elements, an in-place change, or a new tensor at the same address misses and
#   measures its own amax. An entry is taken once; a few are kept at most.
# * Producers do this only while a per-tensor FP8 layer exists (it registers its weight:
#   ``register_fp8_weight``): otherwise a norm would fill slots nobody reads.
import collections  # noqa: E402

from torch.multiprocessing.reductions import StorageWeakRef  # noqa: E402
from torch.utils.weak import WeakIdKeyDictionary  # noqa: E402

FP8_PRODUCERS = True  # False: every cast measures its own amax (A/B: benchmark_fp8.py, gpu_verify.sh fp8producers)
AMAX_SLOTS = 4 if INTERPRET else 32  # atomics spread over this many addresses (fewer collisions)
# The weights of the per-tensor FP8 layers alive (fp8_kernel.FP8Linear registers its own), each
# with the optimizer's record of its amax ("Weights" below): while any is, the producers work.
_WEIGHTS = WeakIdKeyDictionary()  # weight Parameter -> [slots or None, key noted or None]
_PRODUCED = collections.OrderedDict()  # key -> slots, oldest first
_PRODUCED_KEEP = 8  # outputs nobody cast (the last norm before an FP8-less lm_head) fall out


def extent_key(t):
    """What identifies t's elements: storage, first element, rows of [rows, last dim]
    (its leading dims collapsed: a reshape of it to 2-D gives the same key), dtype, version."""
    if t.dim() == 0 or t.numel() == 0 or t.is_inference():  # an inference tensor has no version counter
        return None
    return (StorageWeakRef(t.untyped_storage()), t.data_ptr(), t.numel(), t.shape[-1], t.stride(-1),
            t.stride(-2) if t.dim() > 1 else 0, t.dtype, t._version)


def amax_slots(t, outputs=1):
    """Zeroed float32 slots [outputs, AMAX_SLOTS] (one launch) for a kernel that reads ``t`` to
    fold the max |.| of each of its outputs into, or None where no per-tensor FP8 cast
    could take them the way this channel allows."""
    if not (FP8_PRODUCERS and _WEIGHTS) or traced(t) or torch.compiler.is_compiling():
        return None
    if torch.is_inference_mode_enabled():  # its outputs have no version counter to key on
        return None
    return torch.zeros(outputs, AMAX_SLOTS, dtype=torch.float32, device=t.device)


def note_amax(t, slots):
    """Producer side: the maximum of ``slots`` is max |t| (``slots`` None: nothing to note)."""
    if slots is None or (key := extent_key(t)) is None:
        return
    _PRODUCED[key] = slots
    while len(_PRODUCED) > _PRODUCED_KEEP:
        _PRODUCED.popitem(last=False)


def take_amax(t):
    """Consumer side: the slots a producer noted for exactly ``t``'s elements, unchanged
    since, or None (then the cast measures the amax itself)."""
    if not _PRODUCED or traced(t):
        return None
    key = extent_key(t)
    return _PRODUCED.pop(key, None) if key is not None else None


# Weights: the optimizer is their producer. A weight changes once per step, in the AdamW
# kernel (adamw_kernel.adamw_step), which folds max |new weight| into slots of its own that
# live as long as the weight (the same memory in every step, so a CUDA graph's replayed
# update writes what its replayed forward reads) and notes the weight's key. The next cast
# of that weight, and only that one, takes them; any other change to the weight (an
# in-place op bumps its version; another optimizer notes nothing) leaves the cast to
# measure. Not under FSDP: there the optimizer updates a shard, whose maximum is not the
# gathered weight's (a sharded Parameter is another object, never registered).
def register_fp8_weight(weight):
    """Called by a per-tensor FP8 layer for its weight: the producers work from now on, and
    the optimizer may measure this weight."""
    _WEIGHTS.setdefault(weight, [None, None])


def weight_amax_slots(p):
    """Zeroed slots for the optimizer to fold max |p| into as it updates p, or None where p
    is no registered FP8 weight (or a tracer runs). Invalid until ``note_weight_amax``."""
    record = _WEIGHTS.get(p) if FP8_PRODUCERS else None
    if record is None or traced(p) or torch.compiler.is_compiling():
        return None
    if record[0] is None or record[0].device != p.device:
        record[0] = torch.zeros(AMAX_SLOTS, dtype=torch.float32, device=p.device)
    else:
        record[0].zero_()
    record[1] = None
    return record[0]


def note_weight_amax(p):
    """Optimizer side, after the launch that filled ``weight_amax_slots(p)``."""
    record = _WEIGHTS.get(p)
    if record is not None and record[0] is not None:
        record[1] = extent_key(p)


def take_weight_amax(weight):
    """Cast side: the slots of the update that made ``weight`` as it is now, once; else None."""
    record = _WEIGHTS.get(weight)
    if record is None or record[1] is None or traced(weight) or record[1] != extent_key(weight):
        return None
    record[1] = None
    return record[0]
