"""The one launcher of the persistent GEMM kernel (``tileweave.kernels.gemm.fused_gemm_kernel``),
shared by ``matmul`` and AllGather+GEMM's fused transport, with the launch plans that let a repeat call
skip deriving its arguments again."""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch

from tileweave.kernels.gemm import fused_gemm_kernel
from tileweave.ops.compute.scaling import BLOCK, Scales
from tileweave.runtime import triton_launch
from tileweave.tune.configs import GemmConfig

CONSTEXPR_NAMES = ("BM", "BN", "BN2", "BK", "GROUP_M", "P", "WORLD", "ALL_GATHER", "RING", "STREAM_K", "B_NK",
                   "HAS_BIAS", "USE_TMA", "C_TMA", "FLATTEN", "WARP_SPECIALIZE", "PRECISION", "SCALING")
"""Every constexpr of ``fused_gemm_kernel``, in order: the direct launch passes them all by position."""


def tiles_per_chunk(m_chunk: int, n: int, config: GemmConfig) -> int:
    return math.ceil(m_chunk / config.block_m) * math.ceil(n / (config.block_n + config.block_n2))


def ag_stream_k_tail(m_chunk: int, n: int, config: GemmConfig, world: int, programs: int) -> bool:
    """Whether AllGather+GEMM's kernel can share its partial last wave by K steps: at least one full
    wave, a partial one, and all of its tiles in the last chunk (the kernel's tail reads one chunk)."""
    per_chunk = tiles_per_chunk(m_chunk, n, config)
    rem = world * per_chunk % programs
    return world * per_chunk >= programs and 0 < rem <= per_chunk


def _tma_ok(t: torch.Tensor, contiguous_dim: int) -> bool:
    pitch = t.stride(1 - contiguous_dim) * t.element_size()
    return t.stride(contiguous_dim) == 1 and pitch % 16 == 0 and t.data_ptr() % 16 == 0


def b_layout(b: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``(b, B_NK)``: B_NK when ``b`` [K, N] is the transpose of a row-major [N, K] weight, which the
    kernel reads in place; a ``b`` with neither unit stride is made contiguous."""
    if b.stride(1) == 1:
        return b, False
    if b.stride(0) == 1:
        return b, True
    return b.contiguous(), False


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """Everything a launch derives from shapes, strides, dtypes and alignment: replayed by ``relaunch``
    for later calls with tensors that match in all of those."""

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


PlainLaunch = LaunchPlan


def launch(*, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, bias: torch.Tensor | None,
           config: GemmConfig, m_chunk: int, programs: int, rank: int = 0, world: int = 1,
           gathered: torch.Tensor | None = None, ready: torch.Tensor | None = None,
           err: torch.Tensor | None = None, epoch: int = 0, max_spin: int = 0, ring: bool = False,
           scales: Scales | None = None, gathered_scales: torch.Tensor | None = None,
           compile_only: bool = False) -> LaunchPlan:
    """Launch ``fused_gemm_kernel``: the plain GEMM ``c = a @ b (+ bias)``, or with ``gathered`` (the
    ``[W * m_chunk, K]`` gather buffer, ``ready`` its flags, ``err`` the error word) AllGather+GEMM's
    consumer; with ``scales`` (checked by ``scaling.dense_scales`` for ``a [m_chunk, K]``) float8 ``a``
    and ``b`` scaled, and with ``gathered`` also ``gathered_scales``, the float32 a-scales of the gathered
    rows (``[W * m_chunk, 1]``, or ``[W * m_chunk, K/128]`` for blockwise scales). Returns what a later
    call can replay. ``compile_only`` compiles the kernel these arguments need (on a GPU) without
    launching it."""
    triton_launch.install_allocator()
    all_gather = gathered is not None
    if scales is not None and all_gather and gathered_scales is None:
        raise ValueError("scaled (float8) AllGather+GEMM needs gathered_scales: the a-scales of the gathered rows")
    if scales is not None and scales.kernel_mode == "block":
        if BLOCK % config.block_k:
            raise ValueError(f"blockwise scales need GemmConfig.block_k to divide {BLOCK}, got {config.block_k}")
        # The two-part tile has no per-step scaling (_mainloop_wide): plain tiles.
        config = dataclasses.replace(config, block_n2=0)
    b_in = b
    b, b_nk = b_layout(b)
    k, n = b.shape
    use_tma = _tma_ok(a, 1) and _tma_ok(b, 0 if b_nk else 1) and (not all_gather or _tma_ok(gathered, 1))
    if config.block_n2 and (all_gather or config.stream_k):
        raise ValueError("GemmConfig.block_n2 applies to the plain GEMM without stream_k only")
    if config.block_n2 and not use_tma:
        # The two-part tile reads through TMA only; strides TMA cannot take get plain tiles.
        config = dataclasses.replace(config, block_n2=0)
    c_tma = config.c_tma and use_tma and _tma_ok(c, 1) and m_chunk % config.block_m == 0
    if a.dtype == torch.float32:
        precision = "tf32" if (a.is_cuda and torch.backends.cuda.matmul.allow_tf32) else "ieee"
    else:
        precision = None
    tiles = tiles_per_chunk(m_chunk, n, config) * (world if all_gather else 1)
    stream_k = None
    if config.stream_k and not all_gather:
        # Programs share tiles by K steps: as many programs as steps at most, and a slot of partials for
        # each program's first and last segment.
        programs = max(1, min(programs, tiles * math.ceil(k / config.block_k)))
        stream_k = (2 * programs * config.block_m * config.block_n, tiles)
    else:
        programs = max(1, min(programs, tiles))
        if config.stream_k and ag_stream_k_tail(m_chunk, n, config, world, programs):
            stream_k = (2 * programs * config.block_m * config.block_n, tiles_per_chunk(m_chunk, n, config))
    parts, locks = stream_k_buffers(c.device, *stream_k) if stream_k else (c, c)
    tensors = (a, gathered if all_gather else a, b, c, bias if bias is not None else c,
               ready if ready is not None else c, err if err is not None else c, parts, locks,
               *_scale_tensors(scales, gathered_scales, c))
    ints = (m_chunk, n, k, rank, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
            *_scale_strides(scales, gathered_scales))
    constexprs = (config.block_m, config.block_n, config.block_n2, config.block_k, config.group_m, programs, world,
                  all_gather, ring, stream_k is not None, b_nk, bias is not None, use_tma, c_tma, config.flatten,
                  config.warp_specialize, precision, None if scales is None else scales.kernel_mode)
    _run(tensors, (wrap_int32(epoch), max_spin), ints, constexprs, config.num_warps, config.num_stages, programs,
         compile_only)
    return LaunchPlan(ints=ints, constexprs=constexprs, num_warps=config.num_warps, num_stages=config.num_stages,
                      programs=programs, b_copied=b is not b_in, stream_k=stream_k)


def _scale_tensors(scales: Scales | None, gathered_scales: torch.Tensor | None,
                   c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if scales is None:
        return c, c, c
    return scales.a, scales.b, scales.a if gathered_scales is None else gathered_scales


def _scale_strides(scales: Scales | None, gathered_scales: torch.Tensor | None) -> tuple[int, ...]:
    if scales is None:
        return 0, 0, 0, 0, 0, 0
    gathered = (0, 0) if gathered_scales is None else gathered_scales.stride()
    return (*scales.a_strides, *scales.b_strides[1:], *gathered)


def relaunch(plan: LaunchPlan, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
             bias: torch.Tensor | None, *, gathered: torch.Tensor | None = None,
             ready: torch.Tensor | None = None, err: torch.Tensor | None = None, epoch: int = 0,
             max_spin: int = 0, scales: Scales | None = None, gathered_scales: torch.Tensor | None = None) -> None:
    """A launch again, for tensors that match the ones ``plan`` was made from in shape, strides, dtype,
    device and 16-byte alignment, and the same workspace buffers (the caller's cache key guarantees
    it, scales included); ``epoch`` and ``max_spin`` may change."""
    triton_launch.install_allocator()
    if plan.b_copied:
        b = b.contiguous()
    parts, locks = stream_k_buffers(c.device, *plan.stream_k) if plan.stream_k else (c, c)
    tensors = (a, a if gathered is None else gathered, b, c, c if bias is None else bias,
               c if ready is None else ready, c if err is None else err, parts, locks,
               *_scale_tensors(scales, gathered_scales, c))
    unspecialized = (wrap_int32(epoch), max_spin)
    if plan.compiled and torch.cuda.current_device() == a.device.index:
        # Pointers go to the launcher as ints: given a tensor, Triton's launcher calls its data_ptr()
        # and asks the driver for the pointer's attributes, once per tensor argument. The plan's key
        # guarantees these are CUDA tensors of this device, where (unified addressing) the device
        # pointer is the address itself.
        triton_launch.launch_compiled(plan.compiled[0], a.device.index, plan.programs,
                                      (*(t.data_ptr() for t in tensors), *unspecialized, *plan.ints),
                                      plan.constexprs)
        return
    kernel = _run(tensors, unspecialized, plan.ints, plan.constexprs, plan.num_warps, plan.num_stages,
                  plan.programs)
    if kernel is not None:
        plan.compiled.append(kernel)


def launch_cached(**launch_args) -> None:
    """``launch``, replayed from a plan when this call's arguments match an earlier call's in
    everything the launch derives from them (shapes, strides, dtypes, 16-byte alignment, the
    workspace's buffers, the config): deriving them again costs more host time than a small fused
    call can hide."""
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
    relaunch(plan, launch_args["a"], launch_args["b"], launch_args["c"], get("bias"), gathered=get("gathered"),
             ready=get("ready"), err=get("err"), epoch=get("epoch", 0), max_spin=get("max_spin", 0),
             scales=get("scales"), gathered_scales=get("gathered_scales"))


_fused_plans: dict[tuple, LaunchPlan] = {}


def layout(t: torch.Tensor | None) -> tuple | None:
    """What a launch derives from a tensor argument: shape, strides, dtype, device, 16-byte alignment
    (the key of a replayable launch plan)."""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0)


def _fixed(t: torch.Tensor | None) -> tuple | None:
    # A workspace buffer: its address stands for its alignment, and its row stride for what TMA needs.
    return None if t is None else (t.data_ptr(), t.dtype, t.stride())


def _fused_key(*, a, b, c, bias=None, config, m_chunk, programs, rank=0, world=1, gathered=None, ready=None,
               err=None, epoch=0, max_spin=0, ring=False, scales=None, gathered_scales=None,
               compile_only=False) -> tuple:
    scaled = None if scales is None else (scales.kernel_mode, scales.a_strides, scales.b_strides, layout(scales.a),
                                          layout(scales.b), _fixed(gathered_scales))
    return (config, m_chunk, rank, world, programs, ring, -(1 << 31) <= max_spin < (1 << 31),
            layout(a), layout(b), layout(c), layout(bias), _fixed(gathered), _fixed(ready), _fixed(err),
            a.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32, scaled)


_compiled: dict[tuple, object] = {}


def _int_key(v: int) -> tuple:
    # What Triton specialises an int argument on: equal to 1, divisible by 16, and its width.
    return (v == 1, v % 16 == 0, -(1 << 31) <= v < (1 << 31))


def _compiled_key(tensors, unspecialized, ints, constexprs, num_warps, num_stages) -> tuple:
    return (tensors[0].device.index, constexprs, num_warps, num_stages,
            tuple((t.dtype, t.data_ptr() % 16 == 0) for t in tensors),
            tuple(-(1 << 31) <= v < (1 << 31) for v in unspecialized),
            tuple(_int_key(v) for v in ints))


def _run(tensors, unspecialized, ints, constexprs, num_warps, num_stages, programs, compile_only=False):
    """Launch through a cache of compiled kernels keyed on exactly what Triton specialises on: the
    first call of a key goes through Triton and keeps the compiled kernel; later calls launch it
    directly (``triton_launch``) and return it, so that callers with a fixed key can keep it too.
    ``compile_only``: compile (and keep) without launching; nothing to do in the interpreter."""
    args = (*tensors, *unspecialized, *ints)
    named = dict(zip(CONSTEXPR_NAMES, constexprs))
    cuda = tensors[0].is_cuda
    if compile_only:
        if cuda:
            key = _compiled_key(tensors, unspecialized, ints, constexprs, num_warps, num_stages)
            if key not in _compiled:
                with torch.cuda.device(tensors[0].device):
                    kernel = fused_gemm_kernel.warmup(*args, grid=(programs,), **named, num_warps=num_warps,
                                                      num_stages=num_stages)
                if triton_launch.FAST:
                    _compiled[key] = triton_launch.kept(kernel)
        return None
    if not (triton_launch.FAST and cuda):
        with torch.cuda.device(tensors[0].device) if cuda else contextlib.nullcontext():
            fused_gemm_kernel[(programs,)](*args, **named, num_warps=num_warps, num_stages=num_stages)
        return None
    device = tensors[0].device.index
    key = _compiled_key(tensors, unspecialized, ints, constexprs, num_warps, num_stages)
    kernel = _compiled.get(key)
    if kernel is None:
        with torch.cuda.device(device):
            kernel = fused_gemm_kernel[(programs,)](*args, **named, num_warps=num_warps, num_stages=num_stages)
        _compiled[key] = triton_launch.kept(kernel)
        return None
    with torch.cuda.device(device) if torch.cuda.current_device() != device else contextlib.nullcontext():
        # The compiled function belongs to the tensors' device: launch it there.
        triton_launch.launch_compiled(kernel, device, programs, args, constexprs)
    return kernel


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


def wrap_int32(value: int) -> int:
    """A counter of any size as the int32 the kernel compares cyclically."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value
