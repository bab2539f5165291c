"""The dense layers' SwiGLU backward (``tileweave.ops.compute.swiglu.swiglu_backward``) compiled on a GPU,
with the tiles it takes there: element by element against autograd of ``silu(gate) * up`` in float64 on
the GPU, bf16 and fp32, M and F off the 8 x 512 tiles, x contiguous and a column slice of a wider buffer;
no host synchronisation in a call after the first. Skipped without a CUDA GPU."""

import pytest
import torch

from gpus import needs_gpu
from support.swiglu_reference import check_swiglu_backward
from tileweave.ops.compute.swiglu import swiglu_backward

pytestmark = [pytest.mark.gpu, needs_gpu]


def _check(dx: torch.Tensor, dh: torch.Tensor, x: torch.Tensor) -> None:
    check_swiglu_backward(dx, dh, x, roundings=16)


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
