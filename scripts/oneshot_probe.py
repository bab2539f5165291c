"""The one-shot paths (``policy="oneshot"``) on ONE GPU, its peer played by itself, for what one GPU can
say before two do: the host time of a call and the GPU time of the GEMM and the one-shot kernel.

    python3 scripts/oneshot_probe.py [--op rs|ag] [--shapes MxKxN,...] [--blocks 32x256x4,...] [--out DIR]

A backend of two ranks that both live on this GPU stands in for the group: rank 0's "peer" buffers are
its own, its signal to the peer lands in the flag word it waits on, and the agreement between ranks is
skipped. Columns, per shape (bf16, B an ``nn.Linear`` weight), for GEMM+ReduceScatter (``--op rs``):

``host_us``: the op's host time per call, issued behind 0.3 s of GPU work so that no call waits for the
GPU (the repeat route, as the benchmark's steady state calls it); ``hand_us``: ``torch.matmul`` then
``dist.reduce_scatter_tensor`` on a one-rank NCCL group, the same way (NCCL's host path at one rank);
``part_*_us``: the op's parts alone, the same way (the GEMM, the output's allocation, the kernel's
launch, the check of the error word);
``gemm_us`` and ``oneshot_us``: GPU time per call with the host out of the way (20 calls in a CUDA
graph), the GEMM alone and the GEMM with the reduction kernel, whose "peer" partial is the other slot
(distinct memory, read from this GPU's HBM instead of over NVLink); per ``--blocks`` entry (rows x
columns x warps of the kernel's tiles) the same. ``steady_us``: the op's time per call back to back
(CUDA events, median of 5 x 20 calls), bound by the larger of host and GPU. Writes
``oneshot_probe_<op>.json``. ``--op ag``: AllGather+GEMM's one-shot path the same way (its parts: the
GEMM, the shard's copy into the gather buffer by ``Tensor.copy_`` and by one driver call, the kernel's
launch; ``hand_us``: NCCL's all-gather on a one-rank group and ``torch.matmul``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import tileweave  # noqa: E402
from tileweave.ops import _fused, _launch  # noqa: E402
from tileweave.ops.workspace import ensure_workspace  # noqa: E402
from tileweave.runtime import driver  # noqa: E402
from tileweave.runtime.backend import Backend, HostMirror, SymmetricBuffer  # noqa: E402
from tileweave.tune.autotune import time_ms  # noqa: E402

from host_probe import _graph_us  # noqa: E402  (this folder's host probe; same GPU timing)

# The suite's reduce-scatter rows that run NCCL + cuBLAS under "auto" at TP=2, and two chunked ones
# (M x K_loc x N).
SHAPES = ("1024x2048x4096,2048x2048x4096,1024x7168x4096,1024x4096x8192,1024x14336x8192,1024x24576x12288,"
          "2048x7168x4096,2048x4096x8192")
# The suite's all-gather rows of M <= 2048 that run NCCL + cuBLAS or the chunked transport at TP=2
# (M x K x N_loc).
AG_SHAPES = "1024x4096x3072,2048x4096x3072,1024x4096x14336,2048x4096x14336,1024x8192x5120,2048x8192x5120"


class SelfPeerBackend(Backend):
    """Two ranks on one GPU: rank 0, whose peer's symmetric memory is its own."""

    def __init__(self, device: torch.device) -> None:
        self.group = dist.group.WORLD
        self.rank, self.world_size, self.device = 0, 2, device
        self.interpreter = False
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.default_max_spin = 1 << 26

    def allocate(self, nbytes: int) -> SymmetricBuffer:
        t = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        return SymmetricBuffer(nbytes=nbytes, addresses=(t.data_ptr(),) * 2, views=(t, t))

    def _unused(self, *args) -> None:
        raise NotImplementedError("the one-shot path issues no stream memory op or copy")

    comm_begin = comm_copy = comm_wait = comm_write = comm_end = main_wait = main_write = _unused

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def host_mirror(self) -> HostMirror:
        return HostMirror(self.device)


def _op(device: torch.device, cls=tileweave.GemmReduceScatter):
    backend = SelfPeerBackend(device)
    op = cls(policy="oneshot")
    op._backend = backend
    ws = op._ws = ensure_workspace(None, backend, 0)
    # Rank 1's signal would land in our flag word 1, which is what rank 0 waits on.
    ws.oneshot_signals = lambda: torch.tensor([ws.oneshot.address(0, 4)] * 2, dtype=torch.int64, device=device)
    return op


def _host_us(fn, calls: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(0.3 * 1.4e9))
    start = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    total = (time.perf_counter_ns() - start) / calls / 1e3
    torch.cuda.synchronize()
    return total


def _steady_us(fn) -> float:
    """Back-to-back time per call (CUDA events, median of 5 batches of 20 calls after 30)."""
    return time_ms(fn, torch.device("cuda", torch.cuda.current_device()), warmup=30, iters=20, reps=5) * 1e3


def probe(m: int, k: int, n: int, blocks: list[tuple[int, int, int]], device: torch.device) -> dict:
    torch.manual_seed(m + k + n)
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, k, device=device, dtype=torch.bfloat16).t()
    op = _op(device)
    row = {"shape": f"{m}x{k}x{n}"}
    got = op(a, b)
    ref = (2 * (a.float() @ b.float()))[: m // 2]  # rank 0's rows of two equal partials
    row["rel_err"] = float((got.float() - ref).norm() / ref.norm())
    row["path"] = tileweave.last_path("gemm_reduce_scatter")
    row["host_us"] = _host_us(lambda: op(a, b))
    row["steady_us"] = _steady_us(lambda: op(a, b))
    partial, out = torch.empty(m, n, device=device, dtype=torch.bfloat16), torch.empty(m // 2, n, device=device,
                                                                                        dtype=torch.bfloat16)
    row["hand_us"] = _host_us(lambda: dist.reduce_scatter_tensor(partial, torch.matmul(a, b)))
    # The op's host time by part (each issued alone, as above).
    ws = op._ws
    slots, reduce_plan = ws.plans[("oneshot", m, n, a.dtype)]
    row["part_mm_us"] = _host_us(lambda: torch.mm(a, b, out=slots[0]))
    row["part_new_empty_us"] = _host_us(lambda: a.new_empty((m // 2, n)))
    row["part_launch_us"] = _host_us(lambda: _launch.launch_reduce_rows(reduce_plan, slots[0], out, None,
                                                                        ws.oneshot_epoch))
    row["part_check_us"] = _host_us(lambda: op._oneshot_check(ws, 0))
    row["gemm_us"] = _graph_us(lambda: torch.mm(a, b, out=partial), device)
    # Internals with a fixed epoch (a graph repeats its arguments): the flag holds it after the first run.
    slots = torch.empty(2, m, n, device=device, dtype=torch.bfloat16)
    flags = torch.zeros(4, dtype=torch.int32, device=device)
    default = _launch.ONESHOT_BLOCK
    for block in [default] + [x for x in blocks if x != default]:
        _launch.ONESHOT_BLOCK = block
        plan = _launch.OneshotPlan(peer_offsets=torch.tensor([0, m * n], dtype=torch.int64, device=device),
                                   signals=torch.tensor([flags[1:2].data_ptr()] * 2, dtype=torch.int64, device=device),
                                   ready=flags[:2], err=flags[3:], host_err=op._host_err.tensor, rank=0, world=2,
                                   rows=m // 2, cols=n, max_spin=1 << 26, programs=op._backend.num_sms)

        def call():
            torch.mm(a, b, out=slots[0])
            _launch.launch_reduce_rows(plan, slots[0], out, None, 1)
        name = "oneshot_us" if block == default else "oneshot_us_" + "x".join(map(str, block))
        row[name] = _graph_us(call, device)
    _launch.ONESHOT_BLOCK = default
    row["err_word"] = int(flags[3].item()) + op._host_err.read()
    return row


def probe_ag(m: int, k: int, n: int, device: torch.device) -> dict:
    """AllGather+GEMM's one-shot path: ``m`` gathered rows, ``n`` this rank's columns."""
    torch.manual_seed(m + k + n)
    mc = m // 2
    shard = torch.randn(mc, k, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, k, device=device, dtype=torch.bfloat16).t()
    op = _op(device, tileweave.AllGatherGemm)
    row = {"shape": f"{m}x{k}x{n}"}
    op(shard, b)
    # No peer writes the "peer" rows here: put its shard (this rank's own) there, in both slots.
    for slot in op._ws.plans[("oneshot", m, k, shard.dtype)][0]:
        slot[mc:].copy_(shard)
    got = op(shard, b)
    ref = torch.cat([shard, shard]).float() @ b.float()
    row["rel_err"] = float((got.float() - ref).norm() / ref.norm())
    row["path"] = tileweave.last_path("all_gather_gemm")
    row["host_us"] = _host_us(lambda: op(shard, b))
    row["steady_us"] = _steady_us(lambda: op(shard, b))
    gathered, whole = torch.empty(m, k, device=device, dtype=torch.bfloat16), torch.cat([shard, shard])
    row["hand_us"] = _host_us(lambda: (dist.all_gather_into_tensor(gathered, whole), torch.matmul(gathered, b)))
    ws = op._ws
    slots, gather_plan = ws.plans[("oneshot", m, k, shard.dtype)]
    row["part_mm_us"] = _host_us(lambda: torch.mm(slots[0], b))
    stream = torch.cuda.current_stream().cuda_stream
    row["part_copy_us"] = _host_us(lambda: slots[0][:mc].copy_(shard))
    row["part_driver_copy_us"] = _host_us(lambda: driver.memcpy_async(slots[0][:mc].data_ptr(), shard.data_ptr(),
                                                                      shard.nbytes, stream))
    row["part_launch_us"] = _host_us(lambda: _launch.launch_gather_rows(gather_plan, slots[0], ws.oneshot_epoch))
    out = torch.empty(m, n, device=device, dtype=torch.bfloat16)
    row["gemm_us"] = _graph_us(lambda: torch.mm(gathered, b, out=out), device)
    # Internals with a fixed epoch; the "peer" rows come from the other slot (distinct memory).
    both = torch.empty(2, m, k, device=device, dtype=torch.bfloat16)
    flags = torch.zeros(4, dtype=torch.int32, device=device)
    plan = _launch.OneshotPlan(peer_offsets=torch.tensor([0, m * k], dtype=torch.int64, device=device),
                               signals=torch.tensor([flags[1:2].data_ptr()] * 2, dtype=torch.int64, device=device),
                               ready=flags[:2], err=flags[3:], host_err=op._host_err.tensor, rank=0, world=2,
                               rows=mc, cols=k, parts=1, max_spin=1 << 26, programs=op._backend.num_sms)

    def call():
        both[0][:mc].copy_(shard)
        _launch.launch_gather_rows(plan, both[0], 1)
        torch.mm(both[0], b, out=out)
    row["oneshot_us"] = _graph_us(call, device)
    row["err_word"] = int(flags[3].item()) + op._host_err.read()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--op", choices=("rs", "ag"), default="rs")
    parser.add_argument("--shapes", default="", help=f"MxKxN,... (default rs: {SHAPES}; ag: {AG_SHAPES})")
    parser.add_argument("--blocks", default="16x512x4,64x256x8,32x512x8")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, device_id=device)
    # One rank stands for two: rank 0's proposal is everyone's.
    _fused.agree = lambda backend, cache, op, signature, proposal: cache.setdefault(signature, proposal)
    blocks = [tuple(int(v) for v in x.split("x")) for x in args.blocks.split(",") if x]
    rows = []
    for shape in (args.shapes or (SHAPES if args.op == "rs" else AG_SHAPES)).split(","):
        m, k, n = (int(v) for v in shape.split("x"))
        rows.append(probe(m, k, n, blocks, device) if args.op == "rs" else probe_ag(m, k, n, device))
        print(json.dumps(rows[-1]), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"oneshot_probe_{args.op}.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__,
                   "commit": os.environ.get("TILEWEAVE_GIT_COMMIT", ""), "rows": rows}, f, indent=1)
    keys = [key for key in rows[0] if key.endswith("_us") and not key.startswith("oneshot_us_")]
    print(f"{'shape':20s}" + "".join(f"{key:>22s}" for key in keys) + "   rel_err")
    for row in rows:
        print(f"{row['shape']:20s}" + "".join(f"{row[key]:22.1f}" for key in keys) + f"   {row['rel_err']:.1e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
