"""The fused projection's rotary embedding (``tileweave.ops.compute.rope``) compiled on a GPU, with the
tiles it takes there: the split and rotation and the backward's inverse rotation and join, element by
element against a float64 reference on the GPU (each pair rotated as a complex number); bf16 and fp32,
head sizes 128 and 80, rows off the 32-row tiles, two sequences, ``qkv`` contiguous and a column slice
of a wider buffer; no host synchronisation in a call after the first. Then the block's attention on
``split_heads``' views (grouped keys and values, ``enable_gqa``) against attention on repeated keys and
values in float64. Skipped without a CUDA GPU."""

import pytest
import torch
import torch.nn.functional as F

from gpus import needs_gpu
from support.rope_reference import close, reference, tables
from tileweave.nn.block import split_heads
from tileweave.ops.compute.rope import rope_qkv, rope_qkv_backward

pytestmark = [pytest.mark.gpu, needs_gpu]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("head_dim,strided", [(128, False), (80, True)])
def test_rope_qkv_gpu(dtype, head_dim, strided):
    gen = torch.Generator().manual_seed(head_dim)
    seq, heads, kv_heads = 2050, 8, 2
    rows, width = 2 * seq, (heads + 2 * kv_heads) * head_dim
    shape = dict(seq=seq, heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    for call in range(2):  # fresh inputs; the second call takes the compiled kernels
        buf = torch.randn(rows, width + (64 if strided else 0), generator=gen).to(dtype).cuda()
        qkv = buf[:, 32:32 + width] if strided else buf
        cos, sin = (t.cuda() for t in tables(gen, seq, head_dim, dtype))
        grads = [torch.randn(rows, n * head_dim, generator=gen).to(dtype).cuda() for n in (heads, kv_heads, kv_heads)]
        if call == 1:  # any host synchronisation in the calls raises (the first compiles the kernel)
            torch.cuda.set_sync_debug_mode("error")
        try:
            outs = rope_qkv(qkv, cos, sin, **shape)
            dqkv = rope_qkv_backward(*grads, cos, sin, **shape)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        for name, got, want in zip("qkv", outs, reference(qkv, cos, sin, **shape)):
            close(got, want, name)
        x = qkv.double().requires_grad_(True)
        torch.autograd.backward(reference(x, cos, sin, **shape), [g.double() for g in grads])
        close(dqkv, x.grad, "dqkv")


def test_block_attention_on_grouped_views_gpu():
    # What TPTransformerBlock._forward runs: split_heads' token-major views, attention with enable_gqa;
    # against float64 attention of the reference's q, k, v with keys and values repeated per head.
    gen = torch.Generator().manual_seed(3)
    batch, seq, heads, kv_heads, hd = 2, 1000, 8, 2, 128
    qkv = torch.randn(batch * seq, (heads + 2 * kv_heads) * hd, generator=gen).bfloat16().cuda().requires_grad_(True)
    cos, sin = (t.cuda() for t in tables(gen, seq, hd, torch.bfloat16))
    dy = torch.randn(batch, heads, seq, hd, generator=gen).bfloat16().cuda()
    q, k, v = split_heads(qkv, batch, heads, kv_heads, hd, (cos, sin))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    y.backward(dy)

    x = qkv.detach().double().requires_grad_(True)
    ref = [t.view(batch, seq, -1, hd).transpose(1, 2)
           for t in reference(x, cos, sin, seq, heads, kv_heads, hd)]
    g = heads // kv_heads
    y_ref = F.scaled_dot_product_attention(ref[0], ref[1].repeat_interleave(g, 1), ref[2].repeat_interleave(g, 1),
                                           is_causal=True)
    y_ref.backward(dy.double())
    for name, got, want in (("y", y, y_ref), ("dqkv", qkv.grad, x.grad)):
        err = float((got.detach().double() - want).norm() / want.norm())
        assert err < 2e-2, (name, err)  # bf16 operands and attention's bf16 probabilities
