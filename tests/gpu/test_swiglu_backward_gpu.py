"""The dense layers' SwiGLU backward (``tileweave.ops.compute.swiglu.swiglu_backward``) compiled on a GPU,
with the tiles it takes there: element by element against autograd of ``silu(gate) * up`` in float64 on
the GPU, bf16 and fp32, M and F off the 8 x 512 tiles, x contiguous and a column slice of a wider buffer;
no host synchronisation in a call after the first. Skipped without a CUDA GPU."""

import pytest
import torch
import torch.nn.functional as F

from gpus import needs_gpu
from tileweave.ops.compute.swiglu import swiglu_backward

pytestmark = [pytest.mark.gpu, needs_gpu]


def _check(dx: torch.Tensor, dh: torch.Tensor, x: torch.Tensor) -> None:
    """``dx`` is autograd's float64 gradient rounded to ``x``'s dtype, within a rounding of the output plus
    a few float32 roundings of each term (the GPU's exp is approximate: its error grows with ``|gate|``),
    plus float32's underflow (subnormals flushed)."""
    assert dx.dtype == x.dtype and tuple(dx.shape) == tuple(x.shape) and dx.is_contiguous()
    f = dh.shape[1]
    gate = x[:, :f].double().requires_grad_(True)
    up = x[:, f:].double().requires_grad_(True)
    (F.silu(gate) * up).backward(dh.double())
    ref = torch.cat([gate.grad, up.grad], dim=1)
    g, u, d = gate.detach(), up.detach(), dh.double()
    sig = torch.sigmoid(g)
    scale = torch.cat([(d * u).abs() * sig * (1 + g.abs()) ** 2, (d * g).abs() * sig * (1 + g.abs())], dim=1)
    out, f32 = torch.finfo(x.dtype), torch.finfo(torch.float32)
    bound = out.eps * ref.abs() + 16 * f32.eps * scale + out.smallest_normal * out.eps + f32.smallest_normal
    err = (dx.double() - ref).abs()
    assert torch.isfinite(dx).all(), "non-finite values in dx"
    worst = int((err - bound).argmax())
    assert bool((err <= bound).all()), (f"dx[{worst // dx.shape[1]}, {worst % dx.shape[1]}] = "
                                        f"{dx.flatten()[worst]} vs float64 {ref.flatten()[worst]}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "column-slice"])
def test_swiglu_backward_gpu(dtype, strided):
    gen = torch.Generator(device="cuda").manual_seed(5)
    rows, f = 4099, 1000
    for call in range(2):  # fresh inputs; the second call takes the compiled kernel
        if strided:  # gate | up as columns 64 to 64 + 2F of a wider projection's output; dh with a pitch of its own
            x = torch.randn(rows, 2 * f + 192, device="cuda", generator=gen).to(dtype)[:, 64:64 + 2 * f]
            dh = torch.randn(rows, f + 3, device="cuda", generator=gen).to(dtype)[:, :f]
        else:
            x = torch.randn(rows, 2 * f, device="cuda", generator=gen).to(dtype)
            dh = torch.randn(rows, f, device="cuda", generator=gen).to(dtype)
        if call == 1:  # any host synchronisation in the call raises (the first compiles the kernel)
            torch.cuda.set_sync_debug_mode("error")
        try:
            dx = swiglu_backward(dh, x)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        _check(dx, dh, x)
