"""The dense layers' SwiGLU backward (``tileweave.ops.compute.swiglu.swiglu_backward``, which
``RowParallelLinear(gate_up, swiglu=True)``'s FP8 backward runs) in Triton's interpreter, element by
element against autograd of ``silu(gate) * up`` in float64 on the same inputs: fp32, fp16 and bf16
(bf16 goes through float32 in the interpreter); M and F off the interpreter's 32 x 256 tiles, one row,
F = 1; x a column slice of a wider buffer and dh with a row pitch of its own; gates far out in the
sigmoid's tails; a repeat call with fresh inputs; empty inputs; the refusals by name."""

import pytest
import torch

from tileweave.nn.fused_inputs import swiglu_backward as layer_swiglu_backward
from support.swiglu_reference import check_swiglu_backward
from tileweave.ops.compute.swiglu import swiglu_backward

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _inputs(gen, rows: int, f: int, dtype, *, strided: bool):
    """``dh [rows, f]`` and ``x = gate | up [rows, 2f]`` in ``dtype``; ``strided``: ``x`` columns 8 to 8 + 2f
    of a ``[rows, 2f + 24]`` buffer (a wider projection's output) and ``dh`` of a ``[rows, f + 7]`` one."""
    if strided:
        x = torch.randn(rows, 2 * f + 24, generator=gen).to(dtype)[:, 8:8 + 2 * f]
        dh = torch.randn(rows, f + 7, generator=gen).to(dtype)[:, :f]
    else:
        x = torch.randn(rows, 2 * f, generator=gen).to(dtype)
        dh = torch.randn(rows, f, generator=gen).to(dtype)
    return dh, x


def _check(dx: torch.Tensor, dh: torch.Tensor, x: torch.Tensor) -> None:
    check_swiglu_backward(dx, dh, x, roundings=8)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,f,strided", [(37, 300, False), (70, 260, True), (1, 45, True), (5, 1, False)])
def test_matches_float64(dtype, rows, f, strided):
    gen = torch.Generator().manual_seed(rows * 1000 + f)
    for _ in range(2):  # the second call with fresh inputs takes the cached launch
        dh, x = _inputs(gen, rows, f, dtype, strided=strided)
        _check(swiglu_backward(dh, x), dh, x)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_fp8_layers_backward_runs_it(dtype):
    # fused_inputs.swiglu_backward (RowParallelFP8's backward) on x as the layer saves it
    dh, x = _inputs(torch.Generator().manual_seed(3), 33, 257, dtype, strided=True)
    _check(layer_swiglu_backward(dh, x), dh, x)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # sigmoid(-100) in float32: exp(100) is inf, 0
def test_gates_in_the_sigmoids_tails():
    gen = torch.Generator().manual_seed(11)
    rows, f = 9, 40
    dh, x = _inputs(gen, rows, f, torch.float32, strided=False)
    x[:, :f] = torch.tensor([-100.0, -60.0, -30.0, -8.0, 8.0, 30.0, 60.0, 100.0]).repeat(5)
    _check(swiglu_backward(dh, x), dh, x)


def test_empty_inputs():
    assert tuple(swiglu_backward(torch.empty(0, 40), torch.empty(0, 80)).shape) == (0, 80)
    assert tuple(swiglu_backward(torch.empty(6, 0, dtype=torch.float16),
                                 torch.empty(6, 0, dtype=torch.float16)).shape) == (6, 0)


def test_refusals_name_the_argument():
    dh, x = torch.randn(4, 6), torch.randn(4, 12)
    cases = [
        ((dh, x[0]), ValueError, "x must be 2-D"),
        ((dh, x.double()), TypeError, "x has dtype torch.float64; supported"),
        ((dh, x[:, :11]), ValueError, r"x must be gate \| up, \[M, 2F\] with an even width, got \[4, 11\]"),
        ((dh[:, :5], x), ValueError, r"dh must be \[M, F\] = \[4, 6\] for x \[M, 2F\] = \[4, 12\], got \[4, 5\]"),
        ((dh[:3], x), ValueError, r"dh must be \[M, F\]"),
        ((dh.half(), x), TypeError, "dh has dtype torch.float16 but the other operands are torch.float32"),
        ((torch.empty(4, 6, device="meta"), x), ValueError, "dh is on meta but the other operands are on cpu"),
        ((dh, torch.randn(12, 4).t()), ValueError, r"x must have unit stride along its last dimension.*\(1, 4\)"),
        ((torch.randn(6, 4).t(), x), ValueError, r"dh must have unit stride along its last dimension.*\(1, 4\)"),
        (([[1.0]], x), TypeError, "dh must be a torch.Tensor, got list"),
    ]
    for args, error, match in cases:
        with pytest.raises(error, match=match):
            swiglu_backward(*args)
