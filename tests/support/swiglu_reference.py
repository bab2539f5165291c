"""The check of a dense SwiGLU backward (``tileweave.ops.compute.swiglu.swiglu_backward``) against
autograd of ``silu(gate) * up`` in float64, shared by its CPU and GPU tests."""

import torch
import torch.nn.functional as F


def check_swiglu_backward(dx: torch.Tensor, dh: torch.Tensor, x: torch.Tensor, roundings: int) -> None:
    """``dx`` is autograd's float64 gradient of ``x = gate | up`` for ``dh``, rounded to ``x``'s dtype,
    within a rounding of the output, plus ``roundings`` float32 roundings of each term (the sigmoid's
    error grows with ``|gate|``; a GPU's exp is approximate), plus float32's underflow; a fresh,
    contiguous tensor of ``x``'s dtype and shape."""
    assert dx.dtype == x.dtype and tuple(dx.shape) == tuple(x.shape) and dx.is_contiguous()
    assert dx.untyped_storage().data_ptr() not in (x.untyped_storage().data_ptr(), dh.untyped_storage().data_ptr())
    f = dh.shape[1]
    gate = x[:, :f].double().requires_grad_(True)
    up = x[:, f:].double().requires_grad_(True)
    (F.silu(gate) * up).backward(dh.double())
    ref = torch.cat([gate.grad, up.grad], dim=1)
    g, u, d = gate.detach(), up.detach(), dh.double()
    sig = torch.sigmoid(g)
    scale = torch.cat([(d * u).abs() * sig * (1 + g.abs()) ** 2, (d * g).abs() * sig * (1 + g.abs())], dim=1)
    out, f32 = torch.finfo(x.dtype), torch.finfo(torch.float32)
    bound = out.eps * ref.abs() + roundings * f32.eps * scale + out.smallest_normal * out.eps + f32.smallest_normal
    err = (dx.double() - ref).abs()
    assert bool(torch.isfinite(dx).all()), "non-finite values in dx"
    worst = int((err - bound).argmax())
    assert bool((err <= bound).all()), (f"dx[{worst // dx.shape[1]}, {worst % dx.shape[1]}] = "
                                        f"{dx.flatten()[worst]} vs float64 {ref.flatten()[worst]}")
