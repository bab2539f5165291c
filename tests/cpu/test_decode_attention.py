"""Decode attention over the filled part of a KV cache (``tileweave.kernels.decode_attention``) in Triton's
interpreter against a float64 reference written from the masking rule of ``KVCache.allowed``."""

import zlib

import pytest
import torch

from tileweave.ops.compute.decode_attention import decode_attention


def _reference(q, k, v, valid, slot, limit, scale):
    bsz, heads, dim = q.shape
    kvh = k.shape[1]
    end = min(slot + 1, limit)
    out = torch.empty(bsz, heads, dim, dtype=torch.float64)
    for b in range(bsz):
        keys = [j for j in range(end) if valid[b, j] or j == slot]
        for hq in range(heads):
            h = hq // (heads // kvh)
            kk = k[b, h, keys].double()
            w = torch.softmax(kk @ q[b, hq].double() * scale, dim=0)
            out[b, hq] = w @ v[b, h, keys].double()
    return out


@pytest.mark.parametrize("dtype,bsz,heads,kvh,dim,max_seq,slot,limit,splits", [
    (torch.float32, 2, 8, 2, 64, 100, 70, 100, None),   # grouped 4:1, several spans
    (torch.float16, 1, 5, 1, 80, 64, 63, 64, 3),        # 5 query heads a group, head size off a power of two
    (torch.float32, 3, 4, 4, 32, 200, 17, 18, 7),       # more spans than blocks filled: empty spans merge as nothing
    (torch.float16, 2, 6, 3, 16, 40, 0, 40, 1),         # the first token: only its own key
])
def test_decode_attention_matches_reference(dtype, bsz, heads, kvh, dim, max_seq, slot, limit, splits):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{bsz},{heads},{kvh},{dim},{slot},{dtype}".encode()))
    q = torch.randn(bsz, heads, dim, generator=gen).to(dtype)
    k = torch.randn(bsz, kvh, max_seq, dim, generator=gen).to(dtype)
    v = torch.randn(bsz, kvh, max_seq, dim, generator=gen).to(dtype)
    valid = torch.zeros(bsz, max_seq, dtype=torch.bool)
    valid[:, : slot + 1] = True
    valid[0, : min(3, slot)] = False                 # sequence 0 left-padded
    valid[:, slot + 1:] = torch.rand(bsz, max_seq - slot - 1, generator=gen) < 0.5  # stale slots past the query
    slot_t = torch.tensor(slot, dtype=torch.int64)
    scale = dim ** -0.5
    for _ in range(2):  # the merge's counts must be back at zero for the next call
        out = decode_attention(q, k, v, valid, slot_t, limit=limit, splits=splits)
        ref = _reference(q, k, v, valid, slot, limit, scale)
        err = ((out.double() - ref).norm() / ref.norm()).item()
        assert torch.isfinite(out).all() and err < (1e-5 if dtype == torch.float32 else 2e-3), err


def test_cache_views_and_strided_query():
    # The decoder passes q as a view of [B, H, S=1, D] and one layer of a [L, B, KVH, max_seq, D] cache.
    gen = torch.Generator().manual_seed(7)
    cache_k = torch.randn(3, 2, 2, 48, 32, generator=gen)
    cache_v = torch.randn(3, 2, 2, 48, 32, generator=gen)
    q4 = torch.randn(2, 1, 6, 32, generator=gen).transpose(1, 2)   # [B, H, 1, D], strided
    valid = torch.ones(2, 48, dtype=torch.bool)
    slots = torch.tensor([20], dtype=torch.int64)
    out = decode_attention(q4[:, :, 0], cache_k[1], cache_v[1], valid, slots, limit=48)
    ref = _reference(q4[:, :, 0], cache_k[1], cache_v[1], valid, 20, 48, 32 ** -0.5)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5


def test_bad_shapes_and_dtypes_are_named():
    q = torch.randn(1, 6, 32)
    k = torch.randn(1, 4, 16, 32)
    with pytest.raises(ValueError, match="KVH"):
        decode_attention(q, k, k, torch.ones(1, 16, dtype=torch.bool), torch.tensor(3), limit=16)
    with pytest.raises(ValueError, match="computes bfloat16 wrongly"):  # refused, not computed wrongly
        decode_attention(q.bfloat16(), k.bfloat16(), k.bfloat16(), torch.ones(1, 16, dtype=torch.bool),
                         torch.tensor(3), limit=16)
