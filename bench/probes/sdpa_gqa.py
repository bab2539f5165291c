"""Attention with grouped keys and values, three ways, forward + backward on one GPU: keys and values
repeated to every query head first (``repeat_interleave``, heads-major ``[B, H, S, D]``), the same
tensors with ``enable_gqa=True``, and ``enable_gqa=True`` on views of token-major ``[B, S, H, D]``
storage (the layout a projection writes). Per way: the median time of a step (CUDA events), the
kernels the profiler sees (which backend ran), the output's strides, and the largest difference of the
output and of each input gradient from the first way's. Writes sdpa_gqa.json to argv[1]. Run by hand:
``PYTHONPATH=src python3 bench/probes/sdpa_gqa.py OUT [B,S,H,KV,D ...]``."""
import json
import os
import sys

import torch
import torch.nn.functional as F


def way_repeat(q, k, v):
    g = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1),
                                          is_causal=True)


def way_gqa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def inputs(b, s, h, kv, d, token_major):
    gen = torch.Generator(device="cuda").manual_seed(0)

    def make(heads):  # the same values either way; token-major: [B, S, heads, D] storage
        t = torch.randn((b, heads, s, d), device="cuda", dtype=torch.bfloat16, generator=gen)
        return (t.transpose(1, 2).contiguous().transpose(1, 2) if token_major else t).requires_grad_(True)
    q, k, v = make(h), make(kv), make(kv)
    dy = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    return q, k, v, dy


def step(fn, q, k, v, dy):
    q.grad = k.grad = v.grad = None
    y = fn(q, k, v)
    y.backward(dy)
    return y


def measure(fn, q, k, v, dy, reps=20):
    for _ in range(3):
        step(fn, q, k, v, dy)
    times = []
    for _ in range(reps):
        a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step(fn, q, k, v, dy)
        z.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(z))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step(fn, q, k, v, dy)
        torch.cuda.synchronize()
    kernels = sorted({e.name[:100] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})
    return sorted(times)[len(times) // 2], kernels


def main() -> None:
    out = sys.argv[1]
    shapes = [tuple(int(x) for x in a.split(",")) for a in sys.argv[2:]] or [(1, 8192, 64, 8, 128),
                                                                             (1, 8192, 8, 1, 128)]
    rows = []
    for shape in shapes:
        ref = None
        for name, fn, token_major in (("repeat", way_repeat, False), ("gqa", way_gqa, False),
                                      ("gqa_token_major", way_gqa, True)):
            q, k, v, dy = inputs(*shape, token_major)
            y = step(fn, q, k, v, dy)
            got = [y.detach().float(), q.grad.float(), k.grad.float(), v.grad.float()]
            ms, kernels = measure(fn, q, k, v, dy)
            if ref is None:
                ref = got
            diff = [float((a - r).abs().max()) for a, r in zip(got, ref)]
            rows.append(dict(shape=shape, way=name, ms=ms, out_stride=list(y.stride()),
                             max_diff_y_dq_dk_dv=diff, kernels=kernels))
            print(f"{shape} {name:16s} {ms:7.3f} ms  y strides {tuple(y.stride())}  diff {diff}")
            for kname in kernels:
                print(f"      {kname}")
    with open(os.path.join(out, "sdpa_gqa.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
