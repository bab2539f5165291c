"""Config sweep of the grouped GEMM core on one GPU: for each MoE shape (T=8192, uniform and zipf,
layer 0 and 1), ours under several tile configs against torch._grouped_mm. Steady state via
tileweave.bench.timing.measure; every config verified first. Writes sweep.json to argv[1]."""
import dataclasses, json, sys, time, traceback
import torch
from tileweave.bench import grouped as G
from tileweave.bench.timing import ClockReader, LocalAgreement, TimingConfig, measure
from tileweave.ops.compute.grouped_gemm import grouped_gemm, grouped_config
from tileweave.tune.grouped import GroupedConfig

C = GroupedConfig
CONFIGS = [
    C(block_m=128, block_n=256, block_k=64, num_stages=3, num_warps=8),
    C(block_m=128, block_n=256, block_k=64, num_stages=4, num_warps=8),
    C(block_m=128, block_n=128, block_k=64, num_stages=4, num_warps=8),
    C(block_m=128, block_n=128, block_k=64, num_stages=4, num_warps=4),
    C(block_m=64, block_n=256, block_k=64, num_stages=4, num_warps=8),
    C(block_m=64, block_n=128, block_k=64, num_stages=4, num_warps=4),
    C(block_m=64, block_n=128, block_k=128, num_stages=3, num_warps=4),
    C(block_m=128, block_n=128, block_k=128, num_stages=3, num_warps=8),
]
out_dir = sys.argv[1]
budget = float(sys.argv[2]) if len(sys.argv) > 2 else 150
dev = torch.device("cuda")
timing = TimingConfig(warmup_s=0.2)
clocks = ClockReader()
rows = []
t0 = time.monotonic()
for model in G.MODELS:
    for routing in ("uniform", "zipf"):
        for layer in (0, 1):
            if time.monotonic() - t0 > budget:
                break
            case = G.Case(model, 8192, routing, layer, torch.bfloat16)
            t = G.build_inputs(case, seed=7, device=dev, b_layout="linear")
            k, n = case.k_n
            ref = G._reference(t["a_perm"], t["b"], t["counts"])
            rows_p = case.tokens * model.topk
            row = dict(case.key(), default=dataclasses.asdict(grouped_config(rows_p, n, k, model.experts, torch.bfloat16, dev)), res={})
            a_rows = t["row_token"] if layer == 0 else None
            calls = {"torch": lambda s=t: G._grouped_mm_or_loop(s["a_perm"], s["b"], s["ends"], s["counts"])}
            for i, cfg in enumerate(CONFIGS):
                calls[f"c{i}"] = (lambda s=t, cfg=cfg: grouped_gemm(s["a"], s["b"], s["offsets"], a_rows=a_rows, config=cfg))
            for name, call in calls.items():
                try:
                    err = G._rel_err(call(), ref)
                    if not err < 1e-2:
                        row["res"][name] = {"error": f"rel err {err}"}; continue
                    m = measure(lambda i: call(), cfg=timing, agree=LocalAgreement(), clocks=clocks)
                    row["res"][name] = {"ms": m.ms, "clock": m.clock_mhz}
                except Exception as e:
                    row["res"][name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            tm = row["res"].get("torch", {}).get("ms")
            best = min(((v["ms"], k2) for k2, v in row["res"].items() if k2 != "torch" and "ms" in v), default=None)
            print(f"[{time.monotonic()-t0:5.0f}s] {model.name} {routing} L{layer} torch={tm and round(tm,4)} "
                  + " ".join(f"{k2}={v['ms']:.4f}" if 'ms' in v else f"{k2}=ERR" for k2, v in row["res"].items() if k2 != "torch")
                  + (f" best={best[1]} {tm/best[0]:.3f}x" if best and tm else ""), flush=True)
            rows.append(row)
            del t, ref; torch.cuda.empty_cache()
json.dump({"configs": [dataclasses.asdict(c) for c in CONFIGS], "rows": rows}, open(f"{out_dir}/sweep.json", "w"), indent=1)
