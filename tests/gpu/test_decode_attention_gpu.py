"""Decode attention over the filled part of a KV cache, compiled on a GPU, against float64: bf16 and fp16,
Llama-shaped heads, and a CUDA graph replayed while the query's slot advances on the device (the length
the kernel reads there, not the one it was captured with)."""

import pytest
import torch

from gpus import needs_gpu  # noqa: F401 - skips the module under the interpreter
from tileweave.ops.compute.decode_attention import decode_attention

pytestmark = [pytest.mark.gpu, needs_gpu]
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _reference(q, k, v, valid, slot, limit):
    heads, kvh = q.shape[1], k.shape[1]
    end = min(slot + 1, limit)
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    for b in range(q.shape[0]):
        keys = torch.nonzero(valid[b, :end], as_tuple=True)[0].tolist()
        keys = sorted(set(keys) | {slot})
        for hq in range(heads):
            h = hq // (heads // kvh)
            w = torch.softmax(k[b, h, keys].double() @ q[b, hq].double() * q.shape[2] ** -0.5, dim=0)
            out[b, hq] = w @ v[b, h, keys].double()
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bsz,heads,kvh,dim,max_seq,slot", [(1, 32, 8, 128, 4096, 4000), (8, 8, 1, 128, 2048, 517),
                                                           (3, 40, 8, 80, 1000, 999), (2, 4, 4, 64, 300, 0)])
def test_decode_attention_gpu(dtype, bsz, heads, kvh, dim, max_seq, slot):
    gen = torch.Generator(device="cuda").manual_seed(bsz * 1000 + slot)
    q = torch.randn(bsz, heads, dim, device="cuda", generator=gen).to(dtype)
    k = torch.randn(bsz, kvh, max_seq, dim, device="cuda", generator=gen).to(dtype)
    v = torch.randn(bsz, kvh, max_seq, dim, device="cuda", generator=gen).to(dtype)
    valid = torch.rand(bsz, max_seq, device="cuda", generator=gen) < 0.9
    out = decode_attention(q, k, v, valid, torch.tensor([slot], device="cuda"), limit=max_seq)
    ref = _reference(q, k, v, valid, slot, max_seq)
    assert ((out.double() - ref).norm() / ref.norm()).item() < TOL[dtype]


def test_graph_replay_reads_the_slot_on_the_device():
    bsz, heads, kvh, dim, max_seq = 2, 32, 8, 128, 8192
    q = torch.randn(bsz, heads, dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(bsz, kvh, max_seq, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(bsz, kvh, max_seq, dim, device="cuda", dtype=torch.bfloat16)
    valid = torch.ones(bsz, max_seq, dtype=torch.bool, device="cuda")
    slot = torch.tensor([100], device="cuda")
    decode_attention(q, k, v, valid, slot, limit=max_seq)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, k, v, valid, slot, limit=max_seq)
    for position in (5, 100, 3000, 8191):
        slot.fill_(position)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = _reference(q, k, v, valid, position, max_seq)
        assert ((out.double() - ref).norm() / ref.norm()).item() < TOL[torch.bfloat16], position
