"""Differences between the torch releases torch_sac supports (2.11 to 2.15).

Every place where torch_sac's Python layer depends on the installed torch's
release goes through this module, and each difference names the releases on
each side. Where torch exposes the fact itself (a set, a signature, an
attribute), it is read from torch rather than from the version number. The
C++ counterpart is ``csrc/core/torch_compat.h``.
"""

import inspect
import re

import torch
import torch.utils.checkpoint as _torch_checkpoint

__all__ = [
    "SUPPORTED_RELEASES",
    "TORCH_RELEASE",
    "CHECKPOINT_CLOSES_CONTEXTS_ON_ERROR",
    "check_built_with",
    "checkpoint_frame_entering",
    "fsdp_param_groups",
    "is_compiling",
    "sac_ignored_ops",
    "sac_policy_sees_output",
    "settle_mkl_vml_dispatch",
]


def _release(version):
    """``"2.11.0+cu130"`` -> ``(2, 11, 0)``; the local tag (+cpu, +cu130) is
    the same release: same headers, same C++ ABI."""
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", str(version))
    if match is None:
        raise ValueError(f"torch_sac: cannot read a torch release from {version!r}")
    return tuple(int(g or 0) for g in match.groups())


TORCH_RELEASE = _release(torch.__version__)

#: The releases torch_sac is tested with (major, minor).
SUPPORTED_RELEASES = ((2, 11), (2, 12), (2, 13), (2, 14), (2, 15))


def check_built_with(built_with):
    """Raise ImportError unless the running torch is the release torch_sac's
    extension was built against. torch's C++ ABI differs between releases, so
    a mismatch would crash or misbehave inside the dispatcher."""
    if _release(built_with) != TORCH_RELEASE:
        raise ImportError(
            f"torch_sac was built against torch {built_with}, but torch "
            f"{torch.__version__} is running. Rebuild it against this torch: "
            "pip install --no-build-isolation -e . (from the torch_sac checkout), "
            "or run with the torch it was built for."
        )


# --- PyTorch's SAC calling its policy_fn -------------------------------------
# torch <= 2.11: policy_fn is called before the op runs, without
#   ctx.op_output; torch >= 2.12: after the op, with ctx.op_output set.
# torch <= 2.12: it is asked again during recompute (ctx.is_recompute=True);
#   torch >= 2.13: forward only (recompute looks decisions up by call index).
# The first is read from SelectiveCheckpointContext's signature; the second
# needs no branch: .to_torch() policies count recompute calls per pass
# (torch_sac/_torch_policy.py), so they answer recompute as forward.
_CTX_PARAMS = inspect.signature(_torch_checkpoint.SelectiveCheckpointContext.__init__).parameters


def sac_policy_sees_output():
    """Whether PyTorch's SAC hands ``ctx.op_output`` to ``policy_fn``."""
    return "op_output" in _CTX_PARAMS


def sac_ignored_ops():
    """PyTorch's ``SAC_IGNORED_OPS`` as (``"ns::name"``, overload) pairs.

    The set grows between releases (2.15 adds ``prim.layout.default``);
    torch_sac ignores the union of its own set and the installed torch's.
    """
    pairs = []
    for op in getattr(_torch_checkpoint, "SAC_IGNORED_OPS", ()):
        schema = getattr(op, "_schema", None)
        if schema is None:
            continue
        pairs.append((schema.name, schema.overload_name))
    return pairs


# --- torch.utils.checkpoint's respect_saved_tensors_hooks ----------------------
# torch >= 2.14: checkpoint() takes respect_saved_tensors_hooks (whether
#   tensors SAC saves go through saved_tensors_hooks entered around it);
# torch <= 2.13: it does not, and behaves as respect_saved_tensors_hooks=False.
CHECKPOINT_TAKES_RESPECT_SAVED_TENSORS_HOOKS = (
    "respect_saved_tensors_hooks" in inspect.signature(_torch_checkpoint.checkpoint).parameters
)


# --- torch.utils.checkpoint closing context_fn's contexts on error ------------
# torch >= 2.13: when the checkpointed function raises, checkpoint() throws
#   the error into the generator that entered the contexts, so they exit;
# torch <= 2.12: it does neither, and the contexts stay entered until the
#   garbage collector closes the generator (later, maybe on another thread).
# Read from checkpoint()'s code (does it call gen.throw?), not the version.
_CHECKPOINT_CODE = inspect.unwrap(_torch_checkpoint.checkpoint).__code__
CHECKPOINT_CLOSES_CONTEXTS_ON_ERROR = "throw" in _CHECKPOINT_CODE.co_names
_CONTEXT_GENERATOR_CODE = getattr(
    _torch_checkpoint, "_checkpoint_without_reentrant_generator", None
)
_CONTEXT_GENERATOR_CODE = getattr(_CONTEXT_GENERATOR_CODE, "__code__", None)


def checkpoint_frame_entering(frame):
    """The frame of torch's ``checkpoint()`` whose context generator is
    entering a context from ``frame``, or None when torch's checkpoint closes
    its contexts on error itself (torch >= 2.13) or the context is entered
    some other way."""
    if CHECKPOINT_CLOSES_CONTEXTS_ON_ERROR or frame is None:
        return None
    if frame.f_code is not _CONTEXT_GENERATOR_CODE:
        return None
    caller = frame.f_back  # the frame running next(gen): checkpoint()
    if caller is None or caller.f_code is not _CHECKPOINT_CODE:
        return None
    return caller


# --- torch.compile ------------------------------------------------------------
# torch >= 2.13: torch.compiler.is_compiling() is True while AOTAutograd
#   traces (when torch.utils.checkpoint calls context_fn under compile);
# torch <= 2.12: it is False there; AOTAutograd's tracing shows as an active
#   proxy dispatch mode (what torch.utils.checkpoint itself checks).
_AOT_TRACING_IS_COMPILING = TORCH_RELEASE >= (2, 13)


def _never_compiled_as_a_frame(fn):
    """Dynamo must not compile ``fn`` as a frame of its own (after a graph
    break, eager code calling it would get ``torch.compiler.is_compiling()``
    folded to True); it still inlines it while tracing a caller."""
    eval_frame = getattr(getattr(torch, "_dynamo", None), "eval_frame", None)
    skip_code = getattr(eval_frame, "skip_code", None)
    if skip_code is not None:
        skip_code(fn.__code__)
    return fn


@_never_compiled_as_a_frame
def is_compiling():
    """True while Dynamo traces, and while AOTAutograd traces on every release.

    For code that AOTAutograd reaches (torch.utils.checkpoint calling
    context_fn, PyTorch's SAC calling a policy_fn). Code that only Dynamo
    traces (a region's constructor, a module's forward) calls
    ``torch.compiler.is_compiling()`` directly: Dynamo folds that call into
    the traced frame, which a call through this function does not.
    """
    if torch.compiler.is_compiling():
        return True
    if _AOT_TRACING_IS_COMPILING:
        return False
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is not None


# --- FSDP2 --------------------------------------------------------------------
# torch 2.11: an FSDP state holds one parameter group, `_fsdp_param_group`
#   (None when the module has no parameters of its own);
# torch >= 2.12: a list, `_fsdp_param_groups`.
def fsdp_param_groups(state):
    """The FSDP2 parameter groups of a module's FSDP state, as a list."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


# --- oneMKL's vector math (VML) -----------------------------------------------
# ATen runs contiguous float and double acos, asin, atan, cos, erf, erfc,
# erfinv, exp, log, log10, log2, sin, sqrt, tan, tanh and trunc through MKL
# VML, each intra-op thread on its share. The oneMKL these wheels bundle
# (2024.2; 2.13.0+cpu says "Version 2024.2-Product Build 20240605") picks each
# VML function's kernel on its first call, and when that first call runs on
# several threads at once, one thread can run a low-accuracy kernel over its
# whole share of that one call: about 1e-4 relative error, up to thousands of
# ulp (pytorch/pytorch#188792; fixed in oneMKL 2025). Measured here (2 cores,
# torch 2.13.0+cpu): the first `x.sin()` of a fresh process on a 64x256 tensor
# differed from every later one in half its elements in 11 of 20000 processes
# with 8 intra-op threads, 0 of 20000 after the calls below
# (scripts/mkl_first_call_storm.py). A first
# forward or backward that goes wrong this way makes "the same gradients as
# without checkpointing" fail by chance, whichever run came first.
_VML_FUNCTIONS = (
    "acos", "asin", "atan", "cos", "erf", "erfc", "erfinv", "exp",
    "log", "log10", "log2", "sin", "sqrt", "tan", "tanh", "trunc",
)  # fmt: skip


def settle_mkl_vml_dispatch():
    """Calls each VML function once on one element (one thread), float and
    double, so that oneMKL has chosen its kernels before any op runs them on
    several threads. Results are unchanged: it only moves each function's
    first call. Without MKL (ARM, macOS builds) there is nothing to settle."""
    if not torch.backends.mkl.is_available():
        return
    with torch.no_grad():
        for dtype in (torch.float32, torch.float64):
            half = torch.full((1,), 0.5, dtype=dtype, device="cpu")
            for name in _VML_FUNCTIONS:
                getattr(torch, name)(half)
