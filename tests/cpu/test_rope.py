"""The fused projection's rotary embedding (``tileweave.ops.compute.rope``, which the TP block's
attention takes its q, k and v from) in Triton's interpreter, element by element against a float64
reference that rotates each pair as a complex number: the split and rotation, the backward's inverse
rotation and join (against float64 autograd of the reference), and ``split_heads``' autograd; fp32,
fp16 and bf16 (bf16 through float32 in the interpreter); head sizes that are not powers of two, rows
off the interpreter's tiles, several sequences, one kv head or as many as query heads, a strided
``qkv``; the refusals by name."""

import pytest
import torch

from support.rope_reference import close as _close, reference as _reference, tables as _tables
from tileweave.nn.block import split_heads
from tileweave.ops.compute.rope import rope_qkv, rope_qkv_backward

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

CASES = [  # rows, seq, heads, kv_heads, head_dim, strided
    (37, 37, 4, 2, 8, False),
    (70, 35, 3, 1, 12, True),
    (96, 32, 2, 2, 6, False),
    (1, 1, 1, 1, 2, False),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,seq,heads,kv_heads,head_dim,strided", CASES)
def test_forward_and_backward_match_float64(dtype, rows, seq, heads, kv_heads, head_dim, strided):
    gen = torch.Generator().manual_seed(rows * 100 + head_dim)
    width = (heads + 2 * kv_heads) * head_dim
    for _ in range(2):  # the second call with fresh inputs takes the cached launch
        buf = torch.randn(rows, width + (5 if strided else 0), generator=gen).to(dtype)
        qkv = buf[:, 3:3 + width] if strided else buf
        cos, sin = _tables(gen, seq, head_dim, dtype)
        shape = dict(seq=seq, heads=heads, kv_heads=kv_heads, head_dim=head_dim)
        q, k, v = rope_qkv(qkv, cos, sin, **shape)
        assert all(t.is_contiguous() and t.dtype == dtype for t in (q, k, v))
        for name, got, want in zip("qkv", (q, k, v), _reference(qkv, cos, sin, seq, heads, kv_heads, head_dim)):
            _close(got, want, name)

        grads = [torch.randn(t.shape, generator=gen).to(dtype) for t in (q, k, v)]
        dqkv = rope_qkv_backward(*grads, cos, sin, **shape)
        x = qkv.double().requires_grad_(True)
        outs = _reference(x, cos, sin, seq, heads, kv_heads, head_dim)
        torch.autograd.backward(outs, [g.double() for g in grads])
        assert dqkv.shape == qkv.shape and dqkv.dtype == dtype
        _close(dqkv, x.grad, "dqkv")


def test_split_heads_autograd_and_layout():
    # The block's entry: views [B, n, S, hd] of token-major storage, gradients back to qkv.
    gen = torch.Generator().manual_seed(5)
    batch, seq, heads, kv_heads, hd = 2, 9, 4, 2, 10
    qkv = torch.randn(batch * seq, (heads + 2 * kv_heads) * hd, generator=gen, requires_grad=True)
    cos, sin = _tables(gen, seq, hd, torch.float32)
    q, k, v = split_heads(qkv, batch, heads, kv_heads, hd, (cos, sin))
    assert q.shape == (batch, heads, seq, hd) and k.shape == v.shape == (batch, kv_heads, seq, hd)
    assert q.stride() == (seq * heads * hd, hd, heads * hd, 1)  # token-major storage
    ws = [torch.randn(t.shape, generator=gen) for t in (q, k, v)]
    sum((t * w).sum() for t, w in zip((q, k, v), ws)).backward()

    x = qkv.detach().double().requires_grad_(True)
    ref = _reference(x, cos, sin, seq, heads, kv_heads, hd)
    ref = [t.view(batch, seq, -1, hd).transpose(1, 2) for t in ref]
    for name, got, want in zip("qkv", (q, k, v), ref):
        _close(got.detach(), want.detach(), name)
    sum((t * w.double()).sum() for t, w in zip(ref, ws)).backward()
    _close(qkv.grad, x.grad, "dqkv")

    # Only q used: the unused outputs' gradients count as zeros.
    qkv.grad = None
    q, k, v = split_heads(qkv, batch, heads, kv_heads, hd, (cos, sin))
    (q * ws[0]).sum().backward()
    assert qkv.grad[:, heads * hd:].abs().max() == 0
    x.grad = None
    q_ref = _reference(x, cos, sin, seq, heads, kv_heads, hd)[0].view(batch, seq, -1, hd).transpose(1, 2)
    (q_ref * ws[0].double()).sum().backward()
    _close(qkv.grad, x.grad, "dqkv from q alone")


def test_refusals_name_the_argument():
    qkv = torch.randn(8, 4 * 6)
    cos, sin = torch.ones(4, 3), torch.zeros(4, 3)
    ok = dict(seq=4, heads=2, kv_heads=1, head_dim=6)
    with pytest.raises(ValueError, match="width 24"):
        rope_qkv(qkv, cos, sin, **{**ok, "heads": 3})
    with pytest.raises(ValueError, match="whole sequences"):
        rope_qkv(qkv[:6], cos, sin, **ok)
    with pytest.raises(ValueError, match="head_dim=5 must be even"):
        rope_qkv(torch.randn(8, 20), cos, sin, seq=4, heads=2, kv_heads=1, head_dim=5)
    with pytest.raises(ValueError, match=r"cos must be \[seq, head_dim / 2\]"):
        rope_qkv(qkv, torch.ones(4, 2), sin, **ok)
    with pytest.raises(ValueError, match="unit column stride"):
        rope_qkv(torch.randn(24, 8).t(), cos, sin, **ok)
    with pytest.raises(TypeError, match="dtype"):
        rope_qkv(qkv.to(torch.int32), cos, sin, **ok)
    with pytest.raises(ValueError, match="dk has 7 rows"):
        rope_qkv_backward(torch.randn(8, 12), torch.randn(7, 6), torch.randn(8, 6), cos, sin, **ok)
    with pytest.raises(ValueError, match="dq must have 2 \\* 6 columns"):
        rope_qkv_backward(torch.randn(8, 6), torch.randn(8, 12), torch.randn(8, 6), cos, sin, **ok)


def test_split_heads_with_tables_of_another_dtype():
    # fp16 projections with float32 tables (the rotation reads them as they are); an unused output's
    # gradient is taken as zeros in the projection's dtype.
    gen = torch.Generator().manual_seed(6)
    batch, seq, heads, kv_heads, hd = 1, 5, 2, 1, 4
    qkv = torch.randn(batch * seq, (heads + 2 * kv_heads) * hd, generator=gen).half().requires_grad_(True)
    cos, sin = _tables(gen, seq, hd, torch.float32)
    q, _, _ = split_heads(qkv, batch, heads, kv_heads, hd, (cos, sin))
    w = torch.randn(q.shape, generator=gen).half()
    (q.float() * w.float()).sum().backward()
    assert qkv.grad.dtype == torch.float16 and qkv.grad[:, heads * hd:].abs().max() == 0
    x = qkv.detach().double().requires_grad_(True)
    ref = _reference(x, cos, sin, seq, heads, kv_heads, hd)[0].view(batch, seq, -1, hd).transpose(1, 2)
    (ref * w.double()).sum().backward()
    _close(qkv.grad, x.grad, "dqkv")
