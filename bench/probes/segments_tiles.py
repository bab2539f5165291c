"""Tiles of ``quantize_segments`` (the FP8 MoE weight gradient's operands) on one GPU: for each of the
layer's four operands at an MoE shape (the gathered float8 ``dO`` and ``x`` requantized, ``dy`` and
``wt * h`` in bf16) and each scaling, the time of each ``(BC, num_warps)`` (BR is the 128 rows of a
block) against the default, every result checked equal to the default's bit for bit, with the bytes
each moves over the time (GB/s). Run by hand: ``PYTHONPATH=src python3 bench/probes/segments_tiles.py
OUT [MODEL]`` (``qwen3-30b-a3b`` by default; T = 4096); writes segments.json to OUT."""
import json
import sys

import torch

from tileweave.bench.moe import MODELS
from tileweave.bench.timing import ClockReader, LocalAgreement, TimingConfig, measure
from tileweave.ops.compute import quantize as Q

CANDIDATES = [(32, 4), (64, 4), (64, 8), (128, 4), (128, 8), (256, 8)]
GRANULARITIES = ("tensorwise", "rowwise", "blockwise_1x128")
TIMING = TimingConfig(warmup_s=0.2)
CLOCKS = ClockReader()


def _time(fn) -> float:
    """Median ms of ``fn`` in steady state (``tileweave.bench.timing``, as the benchmark times)."""
    return measure(lambda i: fn(), cfg=TIMING, agree=LocalAgreement(), clocks=CLOCKS).ms


def operands(model: str, tokens: int, gen: torch.Generator) -> dict:
    h, f, e, k = MODELS[model][:4]
    rows = tokens * k
    counts = torch.bincount(torch.randint(0, e, (rows,), generator=gen), minlength=e)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).int().cuda()
    row_token = torch.randint(0, tokens, (rows,), generator=gen).cuda()
    x = torch.randn(tokens, h, generator=gen).cuda()
    ops = {}
    for name in ("dO", "x"):
        for g in GRANULARITIES:  # the gathered float8 rows with the forward's (or dgrad's) scales
            q = Q.quantize(x, g)
            ops[(name, g)] = dict(x=q.data, x_scale=q.scale, rows=row_token, bytes_in=tokens * h)
    ops_bf16 = {"dy": torch.randn(rows, 2 * f, generator=gen).bfloat16().cuda(),
                "wt*h": torch.randn(rows, f, generator=gen).bfloat16().cuda()}
    for name, t in ops_bf16.items():
        for g in GRANULARITIES:
            ops[(name, g)] = dict(x=t, x_scale=None, rows=None, bytes_in=t.numel() * 2)
    return dict(offsets=offsets, experts=e, rows=rows, ops=ops)


def main(out_dir: str, model: str = "qwen3-30b-a3b", tokens: int = 4096) -> None:
    gen = torch.Generator().manual_seed(5)
    shape = operands(model, tokens, gen)
    default = Q.TILES["segments"]
    results = []
    for (name, g), op in shape["ops"].items():
        def call():
            return Q.quantize_segments(op["x"], shape["offsets"], shape["experts"], g, rows=op["rows"],
                                       x_scale=op["x_scale"])
        ref = call()
        cols = op["x"].shape[1]
        moved = shape["rows"] * cols * op["x"].element_size() + shape["rows"] * cols  # read, write float8
        moved *= 1 if g == "blockwise_1x128" else 2  # tensorwise and rowwise read it twice (amax, cast)
        entry = {"operand": name, "granularity": g, "cols": cols, "bytes": moved, "default": list(default), "ms": {}}
        for bc, warps in CANDIDATES:
            Q.TILES["segments"] = (128, bc, warps)
            try:
                got = call()
                same = torch.equal(got.data.view(torch.uint8)[:, :int(got.offsets[-1])],
                                   ref.data.view(torch.uint8)[:, :int(ref.offsets[-1])]) and \
                    torch.equal(got.scale, ref.scale)
                ms = _time(call) if same else None
                entry["ms"][f"{bc}x{warps}"] = ms if same else "MISMATCH"
            finally:
                Q.TILES["segments"] = default
        best = min((v, key) for key, v in entry["ms"].items() if isinstance(v, float))
        entry["best"] = best[1]
        results.append(entry)
        line = " ".join(f"{key} {v:.3f}" if isinstance(v, float) else f"{key} {v}" for key, v in entry["ms"].items())
        print(f"{name:5s} {g:16s} C={cols:5d}: {line}; best {best[1]} at {moved / best[0] / 1e6:.0f} GB/s", flush=True)
    with open(f"{out_dir}/segments.json", "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], *(sys.argv[2:3] or []))
