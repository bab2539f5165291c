"""The FP8 TP block's two costs that bf16 does not have or has faster, apart: its quantize launches and
its GEMMs, on one GPU (world size 1, Llama-3-70B widths, M tokens).

1. Quantize: every ``quantize`` call of one training step of each recipe is recorded, then timed again
   alone (CUDA events, median of 5 batches of 10) with the current tiles and with candidate
   ``(BR, BC, num_warps)`` per kind of launch (group, and whether the input is read transposed); each
   candidate's output is checked bit for bit against the current tiles'. Prints GB/s per call and the
   best tiles per kind; writes them to ``OUT/quantize_tiles.json`` (``fp8_block_profile.py`` takes that
   file through ``TILEWEAVE_PROBE_TILES``).
2. GEMMs: the block's twelve GEMM shapes (four linears: forward, input gradient, weight gradient) in each
   recipe's scalings and accumulation, ``tileweave.matmul`` against torch's scaled matmul, and bf16
   ``torch.mm``.

Run by hand: ``PYTHONPATH=src python3 bench/probes/fp8_block_parts.py OUT [M [RECIPES [PARTS]]]`` (RECIPES
comma-separated, all three by default; PARTS ``quantize``, ``gemm`` or both, the default)."""
import json
import sys

import torch
import torch.distributed as dist

import tileweave
from fp8_accum import _err, _ms  # the same timing and error as the earlier probes (run from this folder)
from tileweave.bench.fp8 import quantize_rows, quantize_weight, torch_scaled_mm
from tileweave.nn import BlockConfig, Float8Recipe, TPTransformerBlock
from tileweave.nn import fp8 as fp8_mod
from tileweave.ops.compute import quantize as quantize_mod
from tileweave.testing.emulated import run_ranks

CONFIG = dict(hidden=8192, heads=64, kv_heads=8, ffn=28672)
CANDIDATES = {
    "row": [(16, 256, 4), (1, 2048, 4), (1, 4096, 8), (1, 8192, 8), (2, 4096, 8), (4, 1024, 4), (8, 512, 4),
            (1, 16384, 16)],
    "row_t": [(32, 128, 4), (64, 64, 4), (128, 32, 4), (64, 128, 8), (128, 64, 8), (16, 256, 4), (256, 16, 4)],
    "tensor": [(64, 128, 8), (32, 256, 8), (16, 512, 8), (64, 256, 8), (128, 128, 8), (8, 1024, 8), (32, 128, 4)],
    "1x128": [(32, 128, 4), (16, 128, 4), (64, 128, 4), (64, 128, 8), (128, 128, 8), (8, 128, 2)],
    "128x128": [(128, 128, 8), (128, 128, 4), (128, 128, 16)],
}


def kind_of(group, stride_xr, stride_xc):
    transposed = stride_xr == 1 and stride_xc != 1
    return group if not transposed else f"{group}_t"


def candidates(kind):
    return CANDIDATES.get(kind, CANDIDATES.get(kind.removesuffix("_t"), []))


def _parts(q):
    """``quantize``'s result as a tuple: one ``Quantized``, or two with ``twin=True``."""
    return q if isinstance(q, tuple) else (q, )


def _tiles_now(group, strides, kw):
    """The tiles the library takes for this call: a 1 x 128 cast with its twin takes square ones."""
    if kw.get("twin") and group == "1x128":
        return quantize_mod.TWIN_TILES
    return quantize_mod.tiles_of(group, *strides, interpreter=False)


def record_step(recipe, x, target, batch):
    calls = []
    real = fp8_mod.quantize

    def recorder(t, granularity, **kw):
        out = real(t, granularity, **kw)
        calls.append((t, granularity, dict(kw)))
        return out

    torch.manual_seed(0)
    block = TPTransformerBlock(BlockConfig(**CONFIG), device="cuda", dtype=torch.bfloat16, fp8=recipe)
    fp8_mod.quantize = recorder
    try:
        loss = torch.nn.functional.mse_loss(block(x, batch).float(), target.float())
        loss.backward()
    finally:
        fp8_mod.quantize = real
    torch.cuda.synchronize()
    del block
    return calls


def quantize_part(m, recipes=("tensorwise", "rowwise", "blockwise")):
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(m, CONFIG["hidden"], device="cuda", dtype=torch.bfloat16, generator=gen)
    target = torch.randn(m, CONFIG["hidden"], device="cuda", dtype=torch.bfloat16, generator=gen)
    real_tiles = quantize_mod.tiles_of
    rows, per_kind = [], {}
    for name in recipes:
        calls = record_step(getattr(Float8Recipe, name)(), x, target, max(1, m // 4096))
        for t, granularity, kw in calls:
            group = quantize_mod._GROUP[granularity]
            strides = t.stride()[::-1] if kw.get("transpose") else t.stride()
            kind = kind_of(group, *strides) + ("+twin" if kw.get("twin") else "")
            # read x, write one byte per element (two with a twin)
            nbytes = t.numel() * t.element_size() + t.numel() * (2 if kw.get("twin") else 1)
            base = _parts(quantize_mod.quantize(t, granularity, **kw))
            row = {"recipe": name, "granularity": granularity, "kind": kind, "shape": list(t.shape),
                   "dtype": str(t.dtype), "transpose": bool(kw.get("transpose")), "MB": nbytes / 1e6, "tiles": {}}
            now = _tiles_now(group, strides, kw)
            for cand in [now] + (candidates(kind) if now != quantize_mod.TWIN_TILES else []):
                quantize_mod.tiles_of = lambda g, sr, sc, interpreter, c=cand: c
                try:
                    got = _parts(quantize_mod.quantize(t, granularity, **kw))
                    same = all(torch.equal(g.data.view(torch.uint8), b.data.view(torch.uint8)) and
                               torch.equal(g.scale, b.scale) for g, b in zip(got, base, strict=True))
                    ms = _ms(lambda: quantize_mod.quantize(t, granularity, **kw)) if same else None
                except Exception as e:  # a tile that does not compile or fit: recorded, not fatal
                    same, ms = repr(e)[:80], None
                finally:
                    quantize_mod.tiles_of = real_tiles
                row["tiles"][str(cand)] = {"ms": ms, "same": same}
            current = row["tiles"][str(now)]["ms"]
            row["current_ms"], row["current_GBps"] = current, nbytes / current / 1e6 if current else None
            rows.append(row)
            for cand, v in row["tiles"].items():
                if v["ms"] is not None:
                    per_kind.setdefault(kind, {}).setdefault(cand, []).append(v["ms"])
            print(f"{name:10s} {granularity:18s} {kind:9s} {str(list(t.shape)):15s} T={row['transpose']!s:5s} "
                  f"{row['MB']:7.1f} MB  now {current:.3f} ms ({row['current_GBps']:.0f} GB/s)  best "
                  + min(((v['ms'], c) for c, v in row['tiles'].items() if v['ms']), default=(0, ''))[1],
                  flush=True)
        del calls
        torch.cuda.empty_cache()
    best = {}
    for kind, by_cand in per_kind.items():
        n = max(len(v) for v in by_cand.values())
        totals = {c: sum(v) for c, v in by_cand.items() if len(v) == n}
        cand = min(totals, key=totals.get)
        best[kind] = {"tiles": json.loads(cand.replace("(", "[").replace(")", "]")), "total_ms": totals[cand],
                      "all_ms": totals}
        print(f"kind {kind}: best {cand} {totals[cand]:.3f} ms over {n} calls; "
              + ", ".join(f"{c} {v:.3f}" for c, v in sorted(totals.items(), key=lambda kv: kv[1])), flush=True)
    return rows, best


def gemm_part(m):
    h, f, kv = CONFIG["hidden"], CONFIG["ffn"], CONFIG["hidden"] // 64 * 8
    linears = {"qkv": (h + 2 * kv, h), "o": (h, h), "gate_up": (2 * f, h), "down": (h, f)}  # (out, in)
    rows = []
    for name, (n_out, n_in) in linears.items():
        # (M, N, K) of forward, input gradient, weight gradient
        for gemm, (mm, nn, kk) in (("fwd", (m, n_out, n_in)), ("dgrad", (m, n_in, n_out)), ("wgrad", (n_out, n_in, m))):
            xb = torch.randn(mm, kk, device="cuda", dtype=torch.bfloat16)
            wb = torch.randn(nn, kk, device="cuda", dtype=torch.bfloat16)
            row = {"linear": name, "gemm": gemm, "m": mm, "n": nn, "k": kk, "bf16_ms": _ms(lambda: xb @ wb.t())}
            for scaling in ("tensorwise", "rowwise", "blockwise"):
                a8, sa, a_deq = quantize_rows(xb, scaling)
                w8, sb, w_deq = quantize_weight(wb, scaling)
                ref = a_deq.double() @ w_deq.double().t()
                fast = gemm == "fwd" and scaling != "blockwise"  # the presets' accumulation
                ours = lambda: tileweave.matmul(a8, w8.t(), scale_a=sa, scale_b=sb, use_fast_accum=fast)
                row[f"{scaling}_err"] = _err(ours().float(), ref)
                row[f"{scaling}_ms"] = _ms(ours)
                theirs, _ = torch_scaled_mm(scaling)
                if scaling != "blockwise":
                    call = lambda: torch._scaled_mm(a8, w8.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                                                    use_fast_accum=fast)
                else:
                    call = (lambda: theirs(a8, w8.t(), sa, sb)) if theirs is not None else None
                if call is not None:
                    row[f"{scaling}_torch_err"] = _err(call().float(), ref)
                    row[f"{scaling}_torch_ms"] = _ms(call)
            rows.append(row)
            print(f"{name:8s} {gemm:6s} {mm}x{nn}x{kk}: bf16 {row['bf16_ms']:.3f}  " + "  ".join(
                f"{s[:5]} {row[f'{s}_ms']:.3f}/{row.get(f'{s}_torch_ms', float('nan')):.3f}"
                for s in ("tensorwise", "rowwise", "blockwise")), flush=True)
            del xb, wb
    for s in ("tensorwise", "rowwise", "blockwise"):
        ours = sum(r[f"{s}_ms"] for r in rows)
        torch_ms = sum(r.get(f"{s}_torch_ms", 0) for r in rows)
        print(f"sum {s}: ours {ours:.2f} ms, torch {torch_ms:.2f} ms, bf16 {sum(r['bf16_ms'] for r in rows):.2f} ms",
              flush=True)
    return rows


def probe(rank, world, out, m, recipes, parts):
    torch.cuda.set_device(rank)
    q_rows, best = quantize_part(m, recipes) if "quantize" in parts else ([], {})
    with open(f"{out}/quantize_tiles.json", "w") as fh:
        json.dump(best, fh, indent=1)
    g_rows = gemm_part(m) if "gemm" in parts else []
    with open(f"{out}/fp8_block_parts.json", "w") as fh:
        json.dump({"quantize": q_rows, "best_tiles": best, "gemm": g_rows}, fh, indent=1)
    dist.barrier()


if __name__ == "__main__":
    run_ranks(1, probe, sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 8192,
              tuple(sys.argv[3].split(",")) if len(sys.argv) > 3 else ("tensorwise", "rowwise", "blockwise"),
              tuple(sys.argv[4].split(",")) if len(sys.argv) > 4 else ("quantize", "gemm"), gpus=True,
              heap_bytes=64 << 20)
