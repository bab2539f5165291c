"""What every op shares on the host: argument checks and what the ranks compare of an argument, the
record of the path each call took, CUDA-graph capture rules, the errors raised from an error word (an
expired wait, out-of-range routing ids), and the gather of rows that the unfused paths share."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from tileweave.runtime import settings
from tileweave.runtime.backend import Backend, CollectiveTimeout, TileweaveError

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

_last_path: dict[str, str] = {}


def last_path(op: str) -> str | None:
    """Which path the last call of ``op`` ("all_gather_gemm", "gemm_reduce_scatter", "gemm_all_reduce",
    "moe_all_gather_gemm", "moe_gemm_reduce_scatter", "matmul") took: one of the names that every op
    shares (``tileweave.ops.skeleton.PATHS``: "local", "fused", "chunked", "oneshot", "twoshot",
    "fallback"), or for ``matmul`` "splitk" (a few rows: the decode-shaped GEMM) or "triton" (the tile
    GEMM)."""
    return _last_path.get(op)


def record_path(op: str, path: str) -> None:
    """Record the path a call of ``op`` took (one of ``tileweave.ops.skeleton.PATHS``, or "splitk" or
    "triton" for ``matmul``)."""
    _last_path[op] = path


_INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter. Read once: Triton itself fixes the mode when the
    kernels are decorated, at import (this saves a lookup on every launch of a small GEMM)."""
    return _INTERPRETING


def debug_mode() -> bool:
    """``TILEWEAVE_DEBUG=1`` (``tileweave.runtime.settings``): every call waits for its GPU work (bounded) and
    reports an expired wait at once instead of at the next call."""
    return settings.debug()


def check_matrix(name: str, t: torch.Tensor, *, dtype: torch.dtype | None = None,
                 device: torch.device | None = None) -> None:
    """Raise unless ``t`` is a 2-D tensor of a supported dtype (and of ``dtype`` on ``device``)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; supported: float16, bfloat16, float32")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name} has dtype {t.dtype} but the other operands are {dtype}; cast them to one dtype")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but the other operands are on {device}")


def describe(t: object) -> str:
    """A tensor's dtype, shape and device for an error message, or the type's name of anything else."""
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{t.dtype} {tuple(t.shape)} on {t.device}"


def signature_of(value: object, *, dims: tuple[int, ...] | None = None) -> object:
    """What the ranks compare of an argument in an agreement (``tileweave.ops.workspace.agree``), as
    text: a tensor's shape (``*`` for the dimensions not in ``dims`` when given, for a tensor whose other
    dimensions may differ by rank), dtype and device type, e.g. ``"[4, *] float16 on cuda"``; None; a
    number or string itself (its repr, so that NaN equals NaN); else the type's name."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        shape = list(value.shape)
        if dims is not None:
            kept = {d % len(shape) for d in dims if -len(shape) <= d < len(shape)}
            shape = [size if d in kept else "*" for d, size in enumerate(shape)]
        return f"[{', '.join(str(size) for size in shape)}] {str(value.dtype).removeprefix('torch.')} on " \
               f"{value.device.type}"
    if isinstance(value, (bool, int, float, str)):
        return repr(value)
    return type(value).__name__


def check_index(name: str, t: torch.Tensor, device: torch.device,
                dtypes: tuple = (torch.int32, torch.int64)) -> None:
    """Raise unless ``t`` is a contiguous 1-D tensor of one of ``dtypes`` on ``device`` (row indices,
    offsets)."""
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype not in dtypes or t.device != device:
        kinds = "/".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} must be a 1-D {kinds} tensor on {device}, got {describe(t)}")
    if t.stride(0) != 1 and t.numel() > 1:
        raise ValueError(f"{name} must be contiguous, got stride {t.stride()}")


def check_runs_dtype(op: str, name: str, t: torch.Tensor) -> None:
    """Refuse bfloat16 where Triton runs in its interpreter (the CPU): the interpreter computes
    bfloat16 loads and dot products wrongly, so a fused op would return garbage silently."""
    if t.dtype == torch.bfloat16 and interpreting():
        raise TypeError(f"{op}: {name} is bfloat16, which Triton's interpreter (TRITON_INTERPRET=1, the CPU) "
                        "computes wrongly; use float16 or float32 on the CPU (bfloat16 runs on GPUs)")


def check_bias(bias: torch.Tensor | None, n: int, dtype: torch.dtype,
               device: torch.device) -> torch.Tensor | None:
    """The bias as the kernel reads it (contiguous), after checking it."""
    if bias is None:
        return None
    if bias.shape != (n,):
        raise ValueError(f"bias must have shape ({n},), got {tuple(bias.shape)}")
    if bias.dtype != dtype or bias.device != device:
        raise TypeError(f"bias is {bias.dtype} on {bias.device}; expected {dtype} on {device}")
    return bias.contiguous()


def check_out(out: torch.Tensor | None, shape: tuple[int, int], dtype: torch.dtype,
              device: torch.device, *, name: str = "out") -> torch.Tensor | None:
    """``out`` after checking its shape, dtype, device and unit stride along its last dimension."""
    if out is None:
        return None
    if tuple(out.shape) != shape or out.dtype != dtype or out.device != device:
        raise ValueError(f"{name} must be a {dtype} tensor of shape {shape} on {device}; got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}")
    if out.stride(1) != 1:
        raise ValueError(f"{name} must have unit stride along its last dimension, got strides {out.stride()}")
    return out


def check_no_grad(op: str, *tensors: torch.Tensor | None, names: tuple[str, ...]) -> None:
    """Refuse, before anything runs, a call whose ``tensors`` (called ``names``) would need a gradient:
    the ops are not differentiable (the TP layers in ``tileweave.nn`` give them a backward)."""
    if not torch.is_grad_enabled():
        return
    wanted = [name for name, t in zip(names, tensors) if isinstance(t, torch.Tensor) and t.requires_grad]
    if wanted:
        verb = "requires" if len(wanted) == 1 else "require"
        raise TypeError(f"{op} is not differentiable, but {', '.join(wanted)} {verb} grad: call it under "
                        "torch.no_grad() (or torch.inference_mode()), or use the layers of tileweave.nn, whose "
                        "backward runs on these ops")


def out_or_new(out: torch.Tensor | None, shape: tuple[int, int], dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
    """``out`` checked as :func:`check_out` does, or a new uninitialised tensor of that shape when None."""
    out = check_out(out, shape, dtype, device)
    return out if out is not None else torch.empty(shape, dtype=dtype, device=device)


BAD_IDS = 1 << 24
"""Error-word code base of a routing plan built from expert ids outside [0, E): ``BAD_IDS + count``
(above every rank code of an expired wait)."""


def raise_code(code: int, op: str, rank: int) -> None:
    """Raise for a nonzero error-word ``code``: ``CollectiveTimeout`` for an expired wait (``1 + src``:
    the shard of rank ``src``; ``100 + src``: rank ``src``'s partials; ``300 + src``: rank ``src``'s
    reduced rows), ``ValueError`` for out-of-range routing ids (``BAD_IDS + count``)."""
    if code >= BAD_IDS:
        raise ValueError(f"{op}: the routing plan was built from {code - BAD_IDS} expert id(s) outside "
                         "[0, num_experts) (moe_plan(..., validate=False) does not check them on the host; they "
                         "were clamped into range, so the results of the call that used the plan are wrong): fix "
                         "the router's ids, or build the plan with validate=True to find the rank that holds them")
    if code >= 300:
        what = f"the reduced rows of rank {code - 300}"
    elif code >= 100:
        what = f"the partials of rank {code - 100}"
    else:
        what = f"the shard of rank {code - 1}"
    raise CollectiveTimeout(f"{op} on rank {rank}: a bounded wait for {what} expired; a peer is missing, "
                            "far behind, or calling the ops in a different order (raise max_spin or "
                            "TILEWEAVE_MAX_SPIN if a rank is legitimately that slow)")


def raise_on_timeout(err: torch.Tensor, op: str, rank: int) -> None:
    """Raise if the error word ``err`` (int32, one element) is set, clearing it (``raise_code``)."""
    code = int(err.item())
    if code:
        err.zero_()
        raise_code(code, op, rank)


def surface_timeout(err: torch.Tensor, op: str, backend: Backend, mirror):
    """After a gated kernel, surface an expired wait recorded in the error word ``err``. On the CPU and in
    debug mode by synchronising and raising now; otherwise without a sync, by refreshing ``mirror`` (a
    host copy of the word, created here when None) for the next call to read. Returns the mirror."""
    if backend.interpreter or debug_mode():
        backend.synchronize()
        raise_on_timeout(err, op, backend.rank)
        return mirror
    if mirror is None:
        mirror = backend.host_mirror()
    mirror.refresh(err)
    return mirror


def capturing(t: torch.Tensor) -> bool:
    """Whether the current CUDA stream is being captured into a CUDA graph (never for CPU tensors)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def capture_refused(op: str, *, graphable_ops: bool = False) -> TileweaveError:
    """The error of a fused path called under CUDA-graph capture with ``policy="fused"``: its flags carry
    host-side epochs that a replay would not advance. ``graphable_ops``: the op also has a graphable
    form (the dense pair, ``GemmAllReduce``)."""
    graphable = (", or construct it with graphable=True (constant-valued flags, replayable: AllGatherGemm "
                 "with any transport, GemmReduceScatter with transport='chunked', GemmAllReduce)") if graphable_ops \
        else ""
    return TileweaveError(f"{op}: the fused path cannot be captured in a CUDA graph (its flags carry host-side "
                          "epochs that a replay would not advance): capture with policy='auto' or 'fallback', "
                          f"which take NCCL under capture{graphable}")


def check_not_capturing(op: str, t: torch.Tensor) -> None:
    """Raise if ``t``'s stream is being captured: ``op``'s path there carries epochs."""
    if capturing(t):
        raise capture_refused(op)


def all_gather_rows(t: torch.Tensor, backend: Backend) -> torch.Tensor:
    """Every rank's ``t [rows, ...]``, rank after rank along the first dimension, on the caller's stream:
    NCCL's all-gather, or gloo's (emulated or GPU-sharing test ranks, whose groups have no
    all_gather_into_tensor). Float8 rows travel as bytes, which every backend moves."""
    t = t.contiguous()
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return all_gather_rows(t.view(torch.uint8), backend).view(t.dtype)
    out = t.new_empty((t.shape[0] * backend.world_size, *t.shape[1:]))
    if dist.get_backend(backend.group) == "nccl":
        dist.all_gather_into_tensor(out, t, group=backend.group)
    else:
        dist.all_gather(list(out.chunk(backend.world_size)), t, group=backend.group)
    return out
