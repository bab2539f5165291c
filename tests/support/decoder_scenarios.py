"""Per-rank checks of the inference layers and the TP decoder, run on emulated ranks by the tests (and
on GPUs by the GPU tests). Each returns plain data (errors, paths, tokens) so that the caller asserts.

References are computed on every rank from the same seeds, unsharded, in float64: the linears' in
the check itself, the decoder's by ``tileweave.testing.decoder_reference`` (which shares no code with
``tileweave.nn.decoder``).
"""

from __future__ import annotations

import dataclasses
import zlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

import tileweave
from tileweave.nn import inference
from tileweave.nn.decoder import DecoderConfig, TPDecoder
from tileweave.nn.linear import ColumnParallelLinear, RowParallelLinear
from tileweave.nn.shards import gather_shards
from tileweave.testing.decoder_reference import random_state_dict, reference_generate, reference_logits


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _randn(shape, *seed_parts) -> torch.Tensor:
    # zlib.crc32, not hash(): string hashing is salted per process and every rank must agree.
    g = torch.Generator().manual_seed(zlib.crc32(repr(seed_parts).encode()))
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    if not torch.isfinite(got).all():
        return float("inf")
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _same_on_every_rank(t: torch.Tensor, group=None) -> bool:
    """Whether ``t`` is bitwise the same on every rank."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return all(torch.equal(p, parts[0]) for p in parts)


def inference_linears_check(rank: int, world: int, m: int, k: int, hidden: int, n: int, dtype: str,
                            bias: bool, calls: int = 2) -> dict:
    """``y = row(silu(column(x)))`` on replicated activations, through the ``sequence_parallel=False``
    layers of ``tileweave.nn.linear``, against float64: the output, the input gradient and every weight
    and bias gradient (this rank's shards), over ``calls`` calls with fresh inputs and weights. Also
    whether the output and the input gradient are bitwise the same on every rank, and the path the
    row-parallel call took."""
    device, dt = _device(), getattr(torch, dtype)
    col = ColumnParallelLinear(k, hidden, bias=bias, sequence_parallel=False, device=device, dtype=dt)
    row = RowParallelLinear(hidden, n, bias=bias, sequence_parallel=False, device=device, dtype=dt)
    hl = hidden // world
    out: dict = {"same_y": True, "same_dx": True}
    for it in range(calls):
        w1, b1 = _randn((hidden, k), "w1", it) / k ** 0.5, _randn((hidden,), "b1", it)
        w2, b2 = _randn((n, hidden), "w2", it) / hidden ** 0.5, _randn((n,), "b2", it)
        x_full, g_full = _randn((m, k), "x", it), _randn((m, n), "g", it)
        col.load_full_state_dict({"weight": w1.to(dt), **({"bias": b1.to(dt)} if bias else {})})
        row.load_full_state_dict({"weight": w2.to(dt), **({"bias": b2.to(dt)} if bias else {})})
        for p in (*col.parameters(), *row.parameters()):
            p.grad = None
        x = x_full.to(device=device, dtype=dt).requires_grad_(True)
        y = row(F.silu(col(x)))
        (y.float() * g_full.to(device=device, dtype=torch.float32)).sum().backward()

        ref = {"w1": w1, "w2": w2, "b1": b1, "b2": b2, "x": x_full}
        ref = {key: v.to(dt).double().requires_grad_(True) for key, v in ref.items()}
        yr = F.linear(F.silu(F.linear(ref["x"], ref["w1"], ref["b1"] if bias else None)), ref["w2"],
                      ref["b2"] if bias else None)
        (yr * g_full).sum().backward()
        cols = slice(rank * hl, (rank + 1) * hl)
        errs = {"y": _rel_err(y, yr), "dx": _rel_err(x.grad, ref["x"].grad),
                "d_col_w": _rel_err(col.weight.grad, ref["w1"].grad[cols]),
                "d_row_w": _rel_err(row.weight.grad, ref["w2"].grad[:, cols])}
        if bias:
            errs["d_col_b"] = _rel_err(col.bias.grad, ref["b1"].grad[cols])
            errs["d_row_b"] = _rel_err(row.bias.grad, ref["b2"].grad)
        for key, e in errs.items():
            out[key] = max(out.get(key, 0.0), e)
        out["same_y"] &= _same_on_every_rank(y.detach())
        out["same_dx"] &= _same_on_every_rank(x.grad)
    out["path"] = tileweave.last_path("gemm_all_reduce")
    return out


def residual_norm_check(rank: int, world: int, m: int, k: int, n: int, dtype: str) -> dict:
    """``inference.row_parallel_residual_norm`` against float64: both outputs, and that they are the
    same on every rank."""
    device, dt = _device(), getattr(torch, dtype)
    kl = k // world
    w, x = _randn((n, k), "rn_w") / k ** 0.5, _randn((m, k), "rn_x")
    r, g = _randn((m, n), "rn_r"), 1 + 0.1 * _randn((n,), "rn_g")
    w, x, r, g = (t.to(dt) for t in (w, x, r, g))
    cols = slice(rank * kl, (rank + 1) * kl)
    normed, h = inference.row_parallel_residual_norm(
        x[:, cols].to(device), w[:, cols].contiguous().to(device), r.to(device), g.to(device), 1e-5)
    hr = r.double() + x.double() @ w.double().t()
    nr = hr * torch.rsqrt(hr.pow(2).mean(-1, keepdim=True) + 1e-5) * g.double()
    return {"normed": _rel_err(normed, nr), "h": _rel_err(h, hr), "same": _same_on_every_rank(normed)
            and _same_on_every_rank(h), "dtype": str(normed.dtype)}


def small_config(world: int, *, layers: int = 2, max_seq: int = 32) -> DecoderConfig:
    """A tiny model that ``world`` ranks can split: heads and kv heads a multiple of ``world``."""
    kv = max(2, world)
    return DecoderConfig(vocab=16 * world, hidden=8 * 2 * kv, layers=layers, heads=2 * kv, kv_heads=kv,
                         ffn=24 * world, rope_theta=10000.0, max_seq=max_seq)


def decoder_check(rank: int, world: int, batch: int, chunks: list[int], steps: int,
                  sequence_parallel: bool = True, seed: int = 0, generate: bool = True, layers: int = 2,
                  whole_cache: bool = False) -> dict:
    """The TP decoder (fp32) against the float64 reference: the prompt prefilled in ``chunks`` (lengths;
    a chunk after the first attends to the cache), then ``steps`` decode steps fed the reference's
    greedy tokens (teacher-forced, so that every step's logits are comparable); the worst relative
    error of each kind, whether the logits were bitwise the same on every rank, the ops' paths; then
    (if ``generate``) ``generate`` from the whole prompt against ``reference_generate``. ``whole_cache``:
    each decode step's keys span every slot of the cache, as a step replayed from a CUDA graph's do
    (the filled ones found on the device)."""
    device = _device()
    c = small_config(world, layers=layers)
    state = random_state_dict(c, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    prompt = torch.randint(0, c.vocab, (batch, sum(chunks)), generator=g)
    want = reference_generate(state, c, prompt, steps)
    full = torch.cat([prompt, want], dim=1)
    ref = reference_logits(state, c, full)                                    # [B, S + steps, V]

    model = TPDecoder(c, prefill_sequence_parallel=sequence_parallel, device=device, dtype=torch.float32)
    model.load_full_state_dict(state)
    cache = model.new_cache(batch)
    out: dict = {"prefill": 0.0, "decode": 0.0, "same": True, "paths": set()}
    start = 0
    for length in chunks:
        logits = model.prefill(full[:, start:start + length].to(device), cache)
        out["prefill"] = max(out["prefill"], _rel_err(logits, ref[:, start:start + length]))
        out["same"] &= _same_on_every_rank(logits)
        sp = sequence_parallel and (batch * length) % world == 0
        out["paths"].add("prefill " + _last_paths(("all_gather_gemm", "gemm_reduce_scatter") if sp
                                                  else ("gemm_all_reduce",)))
        start += length
    for step in range(steps):
        if whole_cache:
            shard = model.decode_shard(full[:, start].to(device), cache, cache.max_seq)
            cache.advance(1)
            logits = gather_shards(shard, 1, model.group)
        else:
            logits = model.decode(full[:, start].to(device), cache)
        out["decode"] = max(out["decode"], _rel_err(logits, ref[:, start]))
        out["same"] &= _same_on_every_rank(logits)
        out["paths"].add("decode " + _last_paths(("gemm_all_reduce",)))
        start += 1
    out["paths"] = sorted(out["paths"])
    out["tokens"] = model.generate(prompt.to(device), steps).cpu().tolist() if generate else None
    out["want"] = want.tolist()
    # How far the reference's choices are from a tie: token equality is meaningful only above errors.
    top2 = ref[:, sum(chunks) - 1:-1].topk(2, dim=-1).values
    out["margin"] = (top2[..., 0] - top2[..., 1]).min().item()
    return out


def _last_paths(names: tuple[str, ...]) -> str:
    return ", ".join(f"{n}={tileweave.last_path(n)}" for n in names)


def decoder_errors_check(rank: int, world: int) -> dict[str, str]:
    """The decoder's refusals, each before any collective: the error message per bad input."""
    c = small_config(world, layers=1, max_seq=4)
    out = {}

    def attempt(name, fn):
        try:
            fn()
        except ValueError as exc:
            out[name] = str(exc)
        else:
            out[name] = "no error"

    attempt("vocab", lambda: TPDecoder(dataclasses.replace(c, vocab=world * 8 + 1)))
    attempt("kv_heads", lambda: DecoderConfig(vocab=8, hidden=16, layers=1, heads=4, kv_heads=3, ffn=8))
    model = TPDecoder(c)
    cache = model.new_cache(2)
    attempt("dtype", lambda: model.prefill(torch.zeros(2, 3), cache))
    attempt("batch", lambda: model.prefill(torch.zeros(3, 2, dtype=torch.long), cache))
    attempt("max_seq", lambda: model.prefill(torch.zeros(2, 5, dtype=torch.long), cache))
    attempt("token_id", lambda: model.prefill(torch.tensor([[1, c.vocab], [0, 2]]), cache))
    attempt("negative_id", lambda: model.prefill(torch.tensor([[1, -1], [0, 2]]), cache))
    return out
