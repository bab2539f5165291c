"""The launcher of the Hopper FP8 GEMM (``tileweave.kernels.gemm_fp8_sm90``), ``matmul``'s route for
float8 inputs on sm_90 where its operands suit TMA: ``a [M, K]`` row-major, ``b`` the transpose of a
row-major ``[N, K]`` weight (``weight.t()``), a contiguous output, every row pitch a multiple of 16 bytes.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from tileweave.ops.compute.scaling import Scales
from tileweave.runtime import triton_launch

@functools.cache
def _is_sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def _rows_ok(t: torch.Tensor) -> bool:
    # Row-major with a row pitch TMA can take.
    return t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0


def suits(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, scales: Scales | None) -> bool:
    """Whether ``c = a @ b`` with these tensors runs on the Hopper FP8 kernel."""
    if scales is None or not a.is_cuda or not _is_sm90(a.device.index or 0):
        return False
    return _rows_ok(a) and _rows_ok(b.t()) and _rows_ok(c) and c.is_contiguous()


def config_for(scales: Scales, out_dtype: torch.dtype, m: int, n: int, k: int) -> dict:
    """Tile, buffers, warps and ``kernel`` (``kernel_of``) of an ``[M, K] @ [K, N]`` call. Fast
    accumulation: 128 x 256 (a 16-bit output: a float32 tile of 128 x 256 leaves too little shared
    memory for the operand buffers). Where each K step's product is summed in fp32, 128 x 128: exact
    scaling on the kernel with a loader warp (``maxnreg``: eight MMA warps and a loader warp within the
    register file; three live register tiles, the sum, the product being added and the next one in
    flight); blockwise on the two-half kernels (one product per warp group and K step, so its scales fit
    in registers): the staged one where TMA can read the scales (``staged_suits``: torch's layouts; 5
    buffers, 4 with a float32 output, whose store tiles take the fifth's shared memory), else the one
    whose warp groups load them (``quantize``'s K-major activation scales among them)."""
    if scales.kernel_mode == "outer_fast" and out_dtype != torch.float32:
        return {"BM": 128, "BN": 256, "BK": 128, "STAGES": 3, "GROUP_M": 8, "num_warps": 8, "kernel": "plain"}
    if scales.kernel_mode == "outer":
        return {"BM": 128, "BN": 128, "BK": 128, "STAGES": 5, "GROUP_M": 8, "num_warps": 8, "maxnreg": 168,
                "kernel": "loader"}
    if staged_suits(scales):
        return {"BM": 128, "BN": 128, "BK": 128, "STAGES": 4 if out_dtype == torch.float32 else 5, "GROUP_M": 8,
                "num_warps": 4, "kernel": "staged"}
    if scales.kernel_mode == "block":
        return {"BM": 128, "BN": 128, "BK": 128, "STAGES": 4, "GROUP_M": 8, "num_warps": 4, "kernel": "halves"}
    return {"BM": 128, "BN": 128, "BK": 128, "STAGES": 5, "GROUP_M": 8, "num_warps": 8, "kernel": "plain"}


_KERNEL_MODES = {"outer": "outer", "outer_fast": "fast", "block": "block"}
_compiled: dict[tuple, object] = {}


def _int_key(v: int) -> tuple:
    # What Triton specialises an int argument on: equal to 1, divisible by 16, and its width.
    return (v == 1, v % 16 == 0, -(1 << 31) <= v < (1 << 31))


def arguments(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, bias: torch.Tensor | None, scales: Scales, *,
              config: dict | None = None, programs: int) -> tuple[int, tuple, tuple, tuple, dict]:
    """``(grid, tensors, ints, constexprs, options)`` of the launch of ``kernel_of(config)`` for these
    operands on a GPU of ``programs`` SMs; ``options``: ``num_warps``, and ``maxnreg`` where the config
    has one."""
    cfg = config or config_for(scales, c.dtype, a.shape[0], b.shape[1], a.shape[1])
    if cfg.get("kernel") == "staged" and not staged_suits(scales):
        raise ValueError("the 'staged' FP8 kernel takes blockwise scales with scale_a M-major (a column pitch "
                         "of a multiple of 16 bytes) and scale_b K-major, on 16-byte aligned storage: "
                         f"got scale_a strides {scales.a_strides}, scale_b strides {scales.b_strides[1:]}")
    if cfg.get("kernel", "plain") != "plain" and scales.kernel_mode == "outer_fast":
        raise ValueError(f"the {cfg['kernel']!r} FP8 kernel sums each K step in fp32: it takes exact and "
                         "blockwise scaling, not use_fast_accum=True")
    m, k = a.shape
    n = b.shape[1]
    weight = b.t()  # [N, K], row-major
    tiles = -(-m // cfg["BM"]) * -(-n // cfg["BN"])
    sam, sak = scales.a_strides
    _, sbk, sbn = scales.b_strides
    tensors = (a, weight, c, scales.a, scales.b, scales.a if bias is None else bias)
    ints = (m, n, k, a.stride(0), weight.stride(0), c.stride(0), sam, sak, sbk, sbn)
    constexprs = (cfg["BM"], cfg["BN"], cfg["BK"], cfg["GROUP_M"], cfg["STAGES"], _KERNEL_MODES[scales.kernel_mode],
                  bias is not None)
    options = {"num_warps": cfg["num_warps"], **({"maxnreg": cfg["maxnreg"]} if "maxnreg" in cfg else {})}
    # "per_sm": programs resident on each SM (their MMAs interleave where one program waits).
    return min(tiles, programs * cfg.get("per_sm", 1)), tensors, ints, constexprs, options


def staged_suits(scales: Scales) -> bool:
    """Whether the staged kernel (``kernel_of``) can bring these scales in by TMA: blockwise, ``scale_a``
    M-major with a column pitch of a multiple of 16 bytes, ``scale_b`` K-major (any pitch), both 16-byte
    aligned (torch's blockwise scaled matmul takes the same layouts)."""
    if scales.kernel_mode != "block":
        return False
    sam, sak = scales.a_strides
    _, sbk, _ = scales.b_strides
    return (sam == 1 and sbk == 1 and (sak * 4) % 16 == 0 and scales.a.data_ptr() % 16 == 0
            and scales.b.data_ptr() % 16 == 0)


def kernel_of(config: dict):
    """The kernel of a config's ``"kernel"``: ``"plain"`` (every mode; its loads issued by the MMA warps),
    ``"loader"`` (exact and blockwise, a loader warp beside ``num_warps`` MMA warps) or ``"halves"``
    (exact and blockwise, a loader warp and two MMA warp groups, ``num_warps`` 4, each its half of a
    tile's rows) or ``"staged"`` (blockwise on the two-half kernel with each step's scales brought into
    shared memory by the loader warp; ``staged_suits``)."""
    from tileweave.kernels import gemm_fp8_sm90 as k
    from tileweave.kernels import gemm_fp8_sm90_halves as halves

    kernels = {"plain": k.fp8_gemm_sm90_kernel, "loader": k.fp8_gemm_sm90_ws_kernel,
               "halves": halves.fp8_gemm_sm90_halves_kernel, "staged": halves.fp8_gemm_sm90_staged_kernel}
    return kernels[config.get("kernel", "plain")]


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """What a launch derived from its operands' shapes, strides, dtypes and alignment: ``relaunch``
    replays it for operands that match in all of those."""

    device: int
    grid: int
    ints: tuple
    constexprs: tuple
    has_bias: bool
    compiled: list = dataclasses.field(default_factory=list, compare=False)
    """The compiled kernel once known: later calls launch it without Triton's launch path."""

    def ready(self) -> bool:
        """Whether ``relaunch`` may replay it now (compiled, and its device is the current one)."""
        return bool(self.compiled) and torch.cuda.current_device() == self.device


def launch(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, bias: torch.Tensor | None, scales: Scales,
           *, config: dict | None = None, programs: int | None = None) -> LaunchPlan:
    """``c = (a * scale_a) @ (b * scale_b) (+ bias)`` on the Hopper kernel (``suits`` holds); returns the
    plan that ``relaunch`` replays."""
    triton_launch.install_allocator()
    device = a.device.index
    cfg = config or config_for(scales, c.dtype, a.shape[0], b.shape[1], a.shape[1])
    grid, tensors, ints, constexprs, options = arguments(
        a, b, c, bias, scales, config=cfg,
        programs=programs or torch.cuda.get_device_properties(device).multi_processor_count)
    plan = LaunchPlan(device, grid, ints, constexprs, bias is not None)
    fn = kernel_of(cfg)
    key = (device, fn, tuple(options.items()), constexprs, tuple((t.dtype, t.data_ptr() % 16 == 0) for t in tensors),
           tuple(_int_key(v) for v in ints))
    kernel = _compiled.get(key) if triton_launch.FAST else None
    with torch.cuda.device(device):
        if kernel is None:
            handle = fn[(grid, )](*tensors, *ints, *constexprs, **options)
            if triton_launch.FAST:
                kernel = _compiled[key] = triton_launch.kept(handle)
        else:
            triton_launch.launch_compiled(kernel, device, grid, (*(t.data_ptr() for t in tensors), *ints),
                                          constexprs)
    if kernel is not None:
        plan.compiled.append(kernel)
    return plan


def relaunch(plan: LaunchPlan, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, bias: torch.Tensor | None,
             scale_a: torch.Tensor, scale_b: torch.Tensor) -> None:
    """``launch`` again for operands that match the plan's in shape, strides, dtype, device and 16-byte
    alignment (the caller's cache key guarantees it, scales included), once ``plan.ready()``."""
    # b is weight.t(): the weight's rows start where b does.
    triton_launch.launch_compiled(plan.compiled[0], plan.device, plan.grid,
                                  (a.data_ptr(), b.data_ptr(), c.data_ptr(), scale_a.data_ptr(), scale_b.data_ptr(),
                                   (scale_a if bias is None else bias).data_ptr(), *plan.ints), plan.constexprs)
