"""Input checks and the one launcher of the persistent GEMM kernel, shared by every op."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from typing import Callable

import torch
import triton
from triton.runtime import _allocation

from tileweave.kernels.gemm import fused_gemm_kernel
from tileweave.kernels.oneshot import gather_rows_kernel, reduce_rows_kernel
from tileweave.runtime.backend import TileweaveError
from tileweave.tune.configs import CE_RELEASES, GemmConfig

MODE_PLAIN, MODE_AG, MODE_RS = 0, 1, 2
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

_last_path: dict[str, str] = {}


def last_path(op: str) -> str | None:
    """Which path the last call of ``op`` ("all_gather_gemm", "gemm_reduce_scatter", "matmul") took:
    "fused" (the fused kernel), "chunked" (cuBLAS per chunk with the copy-engine transport),
    "oneshot" (cuBLAS and one of ``tileweave.kernels.oneshot``'s kernels), "replay" (a CUDA graph of the
    chunked path), "fallback" (NCCL collective and GEMM), "local" (a group of one) or "triton" (matmul)."""
    return _last_path.get(op)


def record_path(op: str, path: str) -> None:
    _last_path[op] = path


_INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter. Read once: Triton itself fixes the mode when the
    kernels are decorated, at import (this saves a lookup on every launch of a small GEMM)."""
    return _INTERPRETING


def env_flag(name: str) -> bool:
    """Whether the environment variable ``name`` is set to something other than empty or 0."""
    return os.environ.get(name, "0") not in ("", "0")


def debug_mode() -> bool:
    return env_flag("TILEWEAVE_DEBUG")


def check_matrix(name: str, t: torch.Tensor, *, dtype: torch.dtype | None = None,
                 device: torch.device | None = None) -> None:
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
    if out is None:
        return None
    if tuple(out.shape) != shape or out.dtype != dtype or out.device != device:
        raise ValueError(f"{name} must be a {dtype} tensor of shape {shape} on {device}; got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}")
    if out.stride(1) != 1:
        raise ValueError(f"{name} must have unit stride along its last dimension, got strides {out.stride()}")
    return out


def b_layout(b: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``(b, B_NK)``: B_NK when ``b`` [K, N] is the transpose of a row-major [N, K] weight, which the
    kernel reads in place; a ``b`` with neither unit stride is made contiguous."""
    if b.stride(1) == 1:
        return b, False
    if b.stride(0) == 1:
        return b, True
    return b.contiguous(), False


def _tma_ok(t: torch.Tensor, contiguous_dim: int) -> bool:
    pitch = t.stride(1 - contiguous_dim) * t.element_size()
    return t.stride(contiguous_dim) == 1 and pitch % 16 == 0 and t.data_ptr() % 16 == 0


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    # Global scratch for device-side tensor descriptors, on the current device, from torch's
    # stream-ordered caching allocator.
    return torch.empty(size, device="cuda" if torch.cuda.is_available() else "cpu", dtype=torch.int8)


def _install_allocator() -> None:
    """Give Triton an allocator for descriptor scratch, unless the caller installed their own. Triton
    keeps it in a context variable, so a new thread starts without one: checked on every launch."""
    current = getattr(_allocation, "_allocator", None)
    if current is None or current.get() is getattr(_allocation, "_NULL_ALLOCATOR", None):
        triton.set_allocator(_scratch)


def tiles_per_chunk(m_chunk: int, n: int, config: GemmConfig) -> int:
    return math.ceil(m_chunk / config.block_m) * math.ceil(n / (config.block_n + config.block_n2))


def ag_stream_k_tail(m_chunk: int, n: int, config: GemmConfig, world: int, programs: int) -> bool:
    """Whether AllGather+GEMM's kernel can share its partial last wave by K steps: at least one full
    wave, a partial one, and all of its tiles in the last chunk (the kernel's tail reads one chunk)."""
    per_chunk = tiles_per_chunk(m_chunk, n, config)
    rem = world * per_chunk % programs
    return world * per_chunk >= programs and 0 < rem <= per_chunk


@dataclasses.dataclass(frozen=True)
class PlainLaunch:
    """Everything a plain GEMM launch derives from shapes, strides, dtypes and alignment: replayed by
    ``relaunch`` for later calls with tensors that match in all of those."""

    ints: tuple
    constexprs: tuple
    num_warps: int
    num_stages: int
    programs: int
    b_copied: bool
    """``b`` had neither unit stride and was made contiguous: later calls must do the same."""
    stream_k: tuple[int, int] | None = None
    """Stream-K: (elements of the partial-tile workspace, number of tiles), the sizes of the buffers
    ``stream_k_buffers`` hands out."""
    compiled: list = dataclasses.field(default_factory=list, compare=False)
    """The compiled kernel once known (CUDA): later calls launch it without building a cache key."""


def launch(*, mode: int, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, bias: torch.Tensor | None,
           config: GemmConfig, m_chunk: int, rank: int = 0, world: int = 1, programs: int,
           buf: torch.Tensor | None = None, peer_offsets: torch.Tensor | None = None,
           peer_flags: torch.Tensor | None = None, flags: torch.Tensor | None = None,
           err: torch.Tensor | None = None, epoch: int = 0, max_spin: int = 0,
           ring: bool = False, compile_only: bool = False) -> PlainLaunch:
    """Launch ``fused_gemm_kernel``; see its docstring for what each argument means per mode. Returns
    what a plain (``MODE_PLAIN``) launch can replay. ``compile_only`` compiles the kernel these
    arguments need (on a GPU) without launching it."""
    _install_allocator()
    if config.stream_k and mode not in (MODE_PLAIN, MODE_AG):
        raise ValueError("GemmConfig.stream_k applies to the plain GEMM and AllGather+GEMM only")
    b_in = b
    b, b_nk = b_layout(b)
    k, n = b.shape
    use_tma = _tma_ok(a, 1) and _tma_ok(b, 0 if b_nk else 1)
    if mode == MODE_AG:
        use_tma = use_tma and _tma_ok(buf, 1)
    if config.block_n2:
        if mode != MODE_PLAIN:
            raise ValueError("GemmConfig.block_n2 applies to the plain GEMM only")
        if not use_tma:
            # The two-part tile reads through TMA only; strides TMA cannot take get plain tiles.
            config = dataclasses.replace(config, block_n2=0)
    c_tma = (config.c_tma and use_tma and mode != MODE_RS and _tma_ok(c, 1)
             and m_chunk % config.block_m == 0)
    if a.dtype == torch.float32:
        precision = "tf32" if (a.is_cuda and torch.backends.cuda.matmul.allow_tf32) else "ieee"
    else:
        precision = None
    dummy = c
    tiles = tiles_per_chunk(m_chunk, n, config) * (world if mode != MODE_PLAIN else 1)
    stream_k = None
    parts = locks = None
    if config.stream_k and mode == MODE_PLAIN:
        # Programs share tiles by K steps: as many programs as steps at most, and a slot of partials for
        # each program's first and last segment.
        programs = max(1, min(programs, tiles * math.ceil(k / config.block_k)))
        stream_k = (2 * programs * config.block_m * config.block_n, tiles)
    else:
        programs = max(1, min(programs, tiles))
        if config.stream_k and ag_stream_k_tail(m_chunk, n, config, world, programs):
            stream_k = (2 * programs * config.block_m * config.block_n, tiles_per_chunk(m_chunk, n, config))
    if stream_k:
        parts, locks = stream_k_buffers(c.device, *stream_k)
    tensors = (a, buf if buf is not None else a, b, c, bias if bias is not None else dummy,
               peer_offsets if peer_offsets is not None else dummy,
               peer_flags if peer_flags is not None else dummy,
               flags if flags is not None else dummy, err if err is not None else dummy,
               parts if parts is not None else dummy, locks if locks is not None else dummy)
    unspecialized = (_i32(epoch), max_spin)
    ints = (m_chunk, n, k, rank, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1))
    constexprs = (config.block_m, config.block_n, config.block_n2, config.block_k, config.group_m, programs, mode,
                  world, b_nk, bias is not None, use_tma, c_tma, config.flatten, config.warp_specialize, precision,
                  config.lazy_wait, config.copy_engine, ring, CE_RELEASES.index(config.ce_release),
                  stream_k is not None, False)
    _run(tensors, unspecialized, ints, constexprs, config.num_warps, config.num_stages, programs, compile_only)
    return PlainLaunch(ints=ints, constexprs=constexprs, num_warps=config.num_warps,
                       num_stages=config.num_stages, programs=programs, b_copied=b is not b_in,
                       stream_k=stream_k)


def relaunch(plan: PlainLaunch, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
             bias: torch.Tensor | None, *, buf: torch.Tensor | None = None,
             peer_offsets: torch.Tensor | None = None, peer_flags: torch.Tensor | None = None,
             flags: torch.Tensor | None = None, err: torch.Tensor | None = None, epoch: int = 0,
             max_spin: int = 0) -> None:
    """A launch again, for tensors that match the ones ``plan`` was made from in shape, strides, dtype,
    device and 16-byte alignment, and the same workspace buffers (the caller's cache key guarantees
    it); ``epoch`` and ``max_spin`` may change."""
    _install_allocator()
    if plan.b_copied:
        b = b.contiguous()
    parts, locks = stream_k_buffers(c.device, *plan.stream_k) if plan.stream_k else (c, c)
    unspecialized = (_i32(epoch), max_spin)
    if plan.compiled and torch.cuda.current_device() == a.device.index:
        # Pointers go to the launcher as ints: given a tensor, Triton's launcher calls its data_ptr()
        # and asks the driver for the pointer's attributes (cuPointerGetAttribute), eleven times a
        # launch. The plan's key guarantees these are CUDA tensors of this device, where (unified
        # addressing) the device pointer is the address itself.
        ap, cp = a.data_ptr(), c.data_ptr()
        pointers = (ap, ap if buf is None else buf.data_ptr(), b.data_ptr(), cp,
                    cp if bias is None else bias.data_ptr(),
                    cp if peer_offsets is None else peer_offsets.data_ptr(),
                    cp if peer_flags is None else peer_flags.data_ptr(),
                    cp if flags is None else flags.data_ptr(), cp if err is None else err.data_ptr(),
                    parts.data_ptr() if plan.stream_k else cp, locks.data_ptr() if plan.stream_k else cp)
        _launch_compiled(plan.compiled[0], a.device.index, plan.programs, (*pointers, *unspecialized, *plan.ints),
                         plan.constexprs)
        return
    tensors = (a, buf if buf is not None else a, b, c, bias if bias is not None else c,
               peer_offsets if peer_offsets is not None else c, peer_flags if peer_flags is not None else c,
               flags if flags is not None else c, err if err is not None else c, parts, locks)
    kernel = _run(tensors, unspecialized, plan.ints, plan.constexprs, plan.num_warps, plan.num_stages,
                  plan.programs)
    if kernel is not None:
        plan.compiled.append(kernel)


def launch_cached(**launch_args) -> None:
    """``launch`` for the fused modes, replayed from a plan when this call's arguments match an earlier
    call's in everything the launch derives from them (shapes, strides, dtypes, 16-byte alignment, the
    workspace's buffers, the config): AllGather+GEMM's fused call went from 230 to 90 us of host time
    on the GPU hosts (NOTES.md, entry 28), which small fused calls cannot hide."""
    a = launch_args["a"]
    if launch_args.get("compile_only"):
        launch(**launch_args)
        return
    key = _fused_key(**launch_args)
    plan = _fused_plans.get(key)
    if plan is None:
        if len(_fused_plans) >= 1024:
            _fused_plans.clear()
        _fused_plans[key] = launch(**launch_args)
        return
    get = launch_args.get
    relaunch(plan, a, launch_args["b"], launch_args["c"], get("bias"), buf=get("buf"), peer_offsets=get("peer_offsets"),
             peer_flags=get("peer_flags"), flags=get("flags"), err=get("err"), epoch=get("epoch", 0),
             max_spin=get("max_spin", 0))


_fused_plans: dict[tuple, PlainLaunch] = {}


def layout(t: torch.Tensor | None) -> tuple | None:
    """What a launch derives from a tensor argument: shape, strides, dtype, device, 16-byte alignment
    (the key of a replayable launch plan)."""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0)


def _fixed(t: torch.Tensor | None) -> tuple | None:
    # A workspace buffer: its address stands for its alignment, and its row stride for what TMA needs.
    return None if t is None else (t.data_ptr(), t.dtype, t.stride())


def _fused_key(*, mode, a, b, c, bias=None, config, m_chunk, rank=0, world=1, programs, buf=None,
               peer_offsets=None, peer_flags=None, flags=None, err=None, epoch=0, max_spin=0, ring=False,
               compile_only=False) -> tuple:
    return (mode, config, m_chunk, rank, world, programs, ring, -(1 << 31) <= max_spin < (1 << 31),
            layout(a), layout(b), layout(c), layout(bias),
            _fixed(buf), _fixed(peer_offsets), _fixed(peer_flags), _fixed(flags), _fixed(err),
            a.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32)


_CONSTEXPR_NAMES = ("BM", "BN", "BN2", "BK", "GROUP_M", "P", "MODE", "WORLD", "B_NK", "HAS_BIAS", "USE_TMA", "C_TMA",
                    "FLATTEN", "WARP_SPECIALIZE", "PRECISION", "LAZY_WAIT",
                    "COPY_ENGINE", "RING", "CE_RELEASE", "STREAM_K", "TIMELINE")
"""Every constexpr of ``fused_gemm_kernel``, in order: the direct launch passes them all by position
(Triton's launcher takes one argument per kernel parameter, constexprs included)."""
_compiled: dict[tuple, object] = {}
_fast_launch = os.environ.get("TILEWEAVE_FAST_LAUNCH", "1") != "0"


def _int_key(v: int) -> tuple:
    # What Triton specialises an int argument on: equal to 1, divisible by 16, and its width.
    return (v == 1, v % 16 == 0, -(1 << 31) <= v < (1 << 31))


def _run(tensors, unspecialized, ints, constexprs, num_warps, num_stages, programs, compile_only=False):
    """Launch through a cache of compiled kernels keyed on exactly what Triton specialises on.

    ``JITFunction.run`` re-derives the specialisation of all ~30 arguments on every call, which costs
    tens of microseconds of host time: more than the whole GEMM on small shapes. Here the first call of
    a key goes through Triton and keeps the compiled kernel; later calls launch it directly (and
    return it, so that callers with a fixed key can keep it too). Set TILEWEAVE_FAST_LAUNCH=0 to
    always go through Triton. ``compile_only``: compile (and keep) without launching; nothing to do in
    the interpreter.
    """
    args = (*tensors, *unspecialized, *ints)
    if compile_only:
        if tensors[0].is_cuda:
            _compile(args, tensors, unspecialized, ints, constexprs, num_warps, num_stages, programs)
        return None
    if not (_fast_launch and tensors[0].is_cuda):
        with torch.cuda.device(tensors[0].device) if tensors[0].is_cuda else contextlib.nullcontext():
            fused_gemm_kernel[(programs,)](*args, **dict(zip(_CONSTEXPR_NAMES, constexprs)),
                                           num_warps=num_warps, num_stages=num_stages)
        return None
    device = tensors[0].device.index
    key = _compiled_key(tensors, unspecialized, ints, constexprs, num_warps, num_stages)
    kernel = _compiled.get(key)
    if kernel is None:
        with torch.cuda.device(device):
            kernel = fused_gemm_kernel[(programs,)](*args, **dict(zip(_CONSTEXPR_NAMES, constexprs)),
                                                    num_warps=num_warps, num_stages=num_stages)
        _compiled[key] = kernel.result() if hasattr(kernel, "result") else kernel
        return None
    if torch.cuda.current_device() != device:
        # The compiled function belongs to the tensors' device: launch it there.
        with torch.cuda.device(device):
            _launch_compiled(kernel, device, programs, args, constexprs)
    else:
        _launch_compiled(kernel, device, programs, args, constexprs)
    return kernel


def _compiled_key(tensors, unspecialized, ints, constexprs, num_warps, num_stages) -> tuple:
    return (tensors[0].device.index, constexprs, num_warps, num_stages,
            tuple((t.dtype, t.data_ptr() % 16 == 0) for t in tensors),
            tuple(-(1 << 31) <= v < (1 << 31) for v in unspecialized),
            tuple(_int_key(v) for v in ints))


def _compile(args, tensors, unspecialized, ints, constexprs, num_warps, num_stages, programs) -> None:
    key = _compiled_key(tensors, unspecialized, ints, constexprs, num_warps, num_stages)
    if key in _compiled:
        return
    with torch.cuda.device(tensors[0].device):
        kernel = fused_gemm_kernel.warmup(*args, grid=(programs,), **dict(zip(_CONSTEXPR_NAMES, constexprs)),
                                          num_warps=num_warps, num_stages=num_stages)
    if _fast_launch:
        _compiled[key] = kernel.result() if hasattr(kernel, "result") else kernel


def _active_hook(hook):
    # Triton 3.6 keeps launch hooks in a chain object that is never None, so its own launch path builds
    # launch metadata and calls the (usually empty) chain on every launch; pass None when it is empty.
    if hook is None or not getattr(hook, "calls", True):
        return None
    return hook


def _launch_compiled(kernel, device: int, programs: int, args: tuple, constexprs: tuple) -> None:
    stream = torch._C._cuda_getCurrentRawStream(device)
    enter = _active_hook(triton.knobs.runtime.launch_enter_hook)
    leave = _active_hook(triton.knobs.runtime.launch_exit_hook)
    metadata = kernel.launch_metadata((programs, 1, 1), stream, *args, *constexprs) if enter else None
    launcher = kernel.run
    scratch = _cached_scratch(launcher, device, stream, programs)
    if scratch is _USE_TRITON:
        launcher(programs, 1, 1, stream, kernel.function, kernel.packed_metadata, metadata, enter, leave,
                 *args, *constexprs)
        return
    # Triton's launcher object would allocate the descriptors' global scratch through the allocator
    # on every launch; hand its C entry point a scratch buffer kept per stream instead.
    launcher.launch(programs, 1, 1, stream, kernel.function, launcher.launch_cooperative_grid,
                    launcher.launch_pdl, scratch, None, kernel.packed_metadata, metadata, enter, leave,
                    *args, *constexprs)


_scratch_buffers: dict[tuple[int, int], tuple[int, torch.Tensor]] = {}
_USE_TRITON = object()


def _cached_scratch(launcher, device: int, stream: int, programs: int):
    """Address of a global-scratch buffer for ``launcher`` on ``stream`` (None when the kernel needs
    none), or ``_USE_TRITON`` to let Triton's launcher allocate: an unknown launcher layout, profiling
    scratch, or a stream being captured.

    Kernels on one stream run one after another, so one buffer per stream is never in use by two
    launches at once. Under CUDA-graph capture the buffer would be baked into the graph and could be
    shared with work on another stream at replay, so captures keep Triton's per-launch allocation.
    """
    size = getattr(launcher, "global_scratch_size", None)
    if (size is None or getattr(launcher, "profile_scratch_size", 1) or not hasattr(launcher, "launch")
            or torch._C._cuda_isCurrentStreamCapturing()):
        return _USE_TRITON
    if size == 0:
        return None
    nbytes = programs * getattr(launcher, "num_ctas", 1) * size
    entry = _scratch_buffers.get((device, stream))
    if entry is None or entry[1].numel() < nbytes:
        buffer = torch.empty(max(nbytes, 1 << 16), dtype=torch.uint8, device=torch.device("cuda", device))
        entry = _scratch_buffers[(device, stream)] = (buffer.data_ptr(), buffer)
    return entry[0]


ONESHOT_BLOCK = (32, 256, 4)
"""The one-shot kernels' tiles: rows, columns, warps (16 KB of bf16 per rank and tile; 16 x 512 and
64 x 256 were no faster, NOTES.md entry 81)."""


@dataclasses.dataclass
class OneshotPlan:
    """The launches of one of ``tileweave.kernels.oneshot``'s kernels for one shape and workspace: every
    argument but the buffers that change per call and the epoch fixed, so that after the first launch
    of a layout (which compiles through Triton) a call costs the host one launch with its pointers as
    ints, as ``relaunch`` does; that launch is most of a one-shot call's host time. ``rows, cols``: the
    output's rows and columns (reduce) or a shard's (gather); ``row0``: this rank's first row (reduce);
    ``parts``: blocks of ``rows x cols`` the kernel moves (gather: one per peer)."""

    peer_offsets: torch.Tensor
    signals: torch.Tensor
    ready: torch.Tensor
    err: torch.Tensor
    host_err: torch.Tensor
    rank: int
    world: int
    rows: int
    cols: int
    max_spin: int
    programs: int
    row0: int = 0
    parts: int = 1
    meet: Callable[[], None] | None = None
    """Called once, before the plan's first launch and after compiling its kernel (on GPUs; the
    interpreter compiles nothing): the op's barrier, so that no rank's kernel spends its bounded wait
    on a peer that is still compiling (seconds with a cold cache). Plans are made on every rank at the
    same call, so every rank meets. A later launch that needs another specialisation (an output of
    another alignment or row stride) compiles inline, unmet: only a spin bound far below the default
    can expire on that."""
    compiled: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        bm, bn, self.warps = ONESHOT_BLOCK
        self.blocks = (bm, bn)
        tiles = -(-self.rows // bm) * -(-self.cols // bn) * self.parts
        self.programs = max(1, min(self.programs, tiles))

    def launch(self, kernel_fn, key: tuple, tensors: tuple, scalars: tuple, constexprs: dict) -> None:
        """Launch ``kernel_fn`` with ``tensors`` (pointer arguments) then ``scalars``: the compiled
        kernel of ``key`` with the pointers as ints if there is one, else through Triton (kept)."""
        device = tensors[0].device
        fast = _fast_launch and device.type == "cuda"
        if self.meet is not None:
            meet, self.meet = self.meet, None
            if device.type == "cuda":
                try:
                    with torch.cuda.device(device):
                        kernel = kernel_fn.warmup(*tensors, *scalars, grid=(self.programs,), **constexprs,
                                                  num_warps=self.warps)
                    if fast:
                        self.compiled[key] = kernel.result() if hasattr(kernel, "result") else kernel
                except Exception:  # noqa: BLE001 - the launch below compiles again and raises the error itself
                    pass
            meet()  # also after a failed compile: the peers are waiting here
        kernel = self.compiled.get(key) if fast else None
        if kernel is not None and torch.cuda.current_device() == device.index:
            _launch_compiled(kernel, device.index, self.programs, (*(t.data_ptr() for t in tensors), *scalars),
                             tuple(constexprs.values()))
            return
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            kernel = kernel_fn[(self.programs,)](*tensors, *scalars, **constexprs, num_warps=self.warps)
        if fast:
            self.compiled[key] = kernel.result() if hasattr(kernel, "result") else kernel


def launch_reduce_rows(plan: OneshotPlan, part: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None,
                       epoch: int) -> None:
    """``out`` = this rank's rows of the sum of every rank's ``part`` (``reduce_rows_kernel``)."""
    has_bias = bias is not None
    stride_p, stride_out = part.stride(0), out.stride(0)
    # What Triton specialises on that can change between calls: alignments, the row strides.
    key = (part.data_ptr() % 16 == 0, out.data_ptr() % 16 == 0, stride_out, has_bias,
           has_bias and bias.data_ptr() % 16 == 0, stride_p)
    tensors = (part, plan.peer_offsets, plan.signals, plan.ready, out, bias if has_bias else out, plan.err,
               plan.host_err)
    scalars = (_i32(epoch), plan.max_spin, plan.rank, plan.rows, plan.cols, plan.row0, stride_p, stride_out)
    plan.launch(reduce_rows_kernel, key, tensors, scalars,
                {"WORLD": plan.world, "BM": plan.blocks[0], "BN": plan.blocks[1], "P": plan.programs,
                 "HAS_BIAS": has_bias})


def launch_gather_rows(plan: OneshotPlan, buf: torch.Tensor, epoch: int) -> None:
    """Every peer's rows of its gather buffer into the same rows of this rank's ``buf``
    (``gather_rows_kernel``)."""
    stride = buf.stride(0)
    tensors = (buf, plan.peer_offsets, plan.signals, plan.ready, plan.err, plan.host_err)
    scalars = (_i32(epoch), plan.max_spin, plan.rank, plan.rows, plan.cols, stride)
    plan.launch(gather_rows_kernel, (buf.data_ptr() % 16 == 0, stride), tensors, scalars,
                {"WORLD": plan.world, "BM": plan.blocks[0], "BN": plan.blocks[1], "P": plan.programs})


_stream_k_kept: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def stream_k_buffers(device: torch.device, part_elems: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 partial-tile workspace and the per-tile arrival counts (zero between calls) of a
    stream-K launch on the current stream of ``device``, grown on demand.

    Kernels on one stream run one after another and each leaves its counts at zero, so one pair per
    stream serves every launch on it. Under CUDA-graph capture each launch gets its own pair, zeroed by a
    captured memset, since a replay may run next to launches on other streams.
    """
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return (torch.empty(part_elems, dtype=torch.float32, device=device),
                torch.zeros(tiles, dtype=torch.int32, device=device))
    stream = torch._C._cuda_getCurrentRawStream(device.index) if device.type == "cuda" else 0
    key = (device.type, device.index, stream)
    kept = _stream_k_kept.get(key)
    if kept is None or kept[0].numel() < part_elems or kept[1].numel() < tiles:
        grown = (torch.empty(max(part_elems, kept[0].numel() if kept else 0), dtype=torch.float32, device=device),
                 torch.zeros(max(tiles, kept[1].numel() if kept else 0), dtype=torch.int32, device=device))
        kept = _stream_k_kept[key] = grown
    return kept


def _i32(value: int) -> int:
    """A counter of any size as the int32 the kernel compares cyclically."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def raise_on_timeout(err: torch.Tensor, op: str, rank: int) -> None:
    code = int(err.item())
    if code == 0:
        return
    from tileweave.runtime.backend import CollectiveTimeout

    err.zero_()
    if code >= 200:
        what = (f"this rank's copy stream to move out the partials of step {code - 200} of the previous "
                "call (its copies wait for the owner to release its receive buffer)")
    elif code >= 100:
        what = f"the partial tiles from rank {code - 100}"
    else:
        what = f"the shard of rank {code - 1}"
    raise CollectiveTimeout(f"{op} on rank {rank}: a bounded wait for {what} expired; a peer is missing, "
                            "far behind, or calling the ops in a different order (raise TILEWEAVE_MAX_SPIN "
                            "if a rank is legitimately that slow)")


def capturing(t: torch.Tensor) -> bool:
    """Whether the current CUDA stream is being captured into a CUDA graph (never for CPU tensors)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


CAPTURE_FUSED = ("its fused path cannot be captured in a CUDA graph with this op object: its flags carry "
                 "host-side epochs that a replay would not advance. Construct it with graphable=True "
                 "(constant-valued flags, replayable: AllGatherGemm with any transport, GemmReduceScatter "
                 "with transport='chunked'), capture with policy='fallback', or capture at shapes where "
                 "policy='auto' takes the unfused path (tileweave.last_path says which)")


def check_not_capturing(op: str, t: torch.Tensor) -> None:
    if capturing(t):
        raise TileweaveError(f"{op}: {CAPTURE_FUSED}")
