"""A decode step's attention over a KV cache of ``max_seq`` slots of which ``context`` are filled: ours
(``tileweave.ops.compute.decode_attention``: the filled slots only, their count read on the device) beside
torch's SDPA over the whole cache with the decoder's mask (what a CUDA-graph step ran before), and SDPA
over the filled slots alone (what an eager step with a host length runs). Llama-3-8B heads (32 query, 8
key/value heads of 128, bf16). Times are CUDA-graph replays of 20 calls, the median of 5; outputs checked
against each other first. Run by hand: ``PYTHONPATH=src python3 bench/probes/decode_attention.py OUT``."""
import json
import sys

import torch
import torch.nn.functional as F

from decode_splitk import graph_ms  # the probes' graph timing (run from this folder's path)
from tileweave.ops.compute.decode_attention import decode_attention

HEADS, KV, DIM = 32, 8, 128


def main(out):
    rows = []
    for batch in (1, 8, 32):
        for max_seq in (4096, 32768):
            k = torch.randn(batch, KV, max_seq, DIM, device="cuda", dtype=torch.bfloat16)
            v = torch.randn(batch, KV, max_seq, DIM, device="cuda", dtype=torch.bfloat16)
            valid = torch.zeros(batch, max_seq, dtype=torch.bool, device="cuda")
            for context in (512, 4096):
                valid.zero_()
                valid[:, :context] = True
                q = torch.randn(batch, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
                slot = torch.tensor([context - 1], device="cuda")
                mask = valid[:, None, None, :]
                ours = lambda: decode_attention(q, k, v, valid, slot, limit=max_seq)  # noqa: E731
                full = lambda: F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask,  # noqa: E731
                                                              enable_gqa=True)
                filled = lambda: F.scaled_dot_product_attention(  # noqa: E731
                    q[:, :, None], k[:, :, :context], v[:, :, :context], enable_gqa=True)
                ref = filled()[:, :, 0].double()
                err = float((ours().double() - ref).norm() / ref.norm())
                row = {"batch": batch, "max_seq": max_seq, "context": context, "err": err,
                       "ours_ms": graph_ms(ours), "sdpa_full_ms": graph_ms(full), "sdpa_filled_ms": graph_ms(filled),
                       "kv_bytes": 2 * batch * KV * context * DIM * 2}
                row["ours_gbs"] = row["kv_bytes"] / row["ours_ms"] / 1e6
                rows.append(row)
                print(f"B={batch:3d} max_seq={max_seq:6d} context={context:5d}: ours {row['ours_ms'] * 1e3:7.1f} us "
                      f"({row['ours_gbs']:5.0f} GB/s), sdpa masked whole cache {row['sdpa_full_ms'] * 1e3:7.1f}, "
                      f"sdpa filled only {row['sdpa_filled_ms'] * 1e3:7.1f}; err {err:.1e}", flush=True)
            del k, v
    with open(f"{out}/decode_attention.json", "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
