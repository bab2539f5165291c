"""The ops on real GPUs against float64 references (bf16 and fp16). Skipped without CUDA GPUs."""

import pytest
import torch

from gpus import RANKS, SHARED, needs_gpu, needs_two, one_gpu_per_rank
import tileweave
from support import repeat_paths, scenarios
from tileweave.testing.emulated import run_ranks

pytestmark = pytest.mark.gpu
needs_own_gpus = one_gpu_per_rank("NCCL or PyTorch symmetric memory, or a copy-engine transport; "
                                  "tileweave.testing.shared_gpu")
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _rel(got, ref):
    assert torch.isfinite(got).all()
    return ((got.double() - ref).norm() / ref.norm()).item()


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k", [(4096, 4096, 4096), (1000, 3000, 1000), (333, 517, 1001), (8192, 768, 4096)])
@pytest.mark.parametrize("weight_layout", [True, False])
def test_matmul(dtype, m, n, k, weight_layout):
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    b = (torch.randn(n, k, device="cuda", dtype=dtype).t() if weight_layout
         else torch.randn(k, n, device="cuda", dtype=dtype))
    bias = torch.randn(n, device="cuda", dtype=dtype)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
    tileweave.matmul(a, b, bias=bias, out=out)
    assert _rel(out, a.double() @ b.double() + bias.double()) < TOL[dtype]


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k", [(1024, 768, 4096), (1024, 1280, 8192), (333, 517, 1001), (64, 4000, 4096),
                                   (1000, 1300, 512)])
@pytest.mark.parametrize("tile", ["default", "small", "wide"])
def test_matmul_narrow_tiles_gpu(dtype, m, n, k, tile):
    # The plain GEMM's 64-row tiles: 64 x 128, and 64 x 160 in two accumulators (128 + 32 columns),
    # both layouts of B, edges in M and N.
    from tileweave.tune.configs import SMALL_TILE, WIDE_TILE

    config = {"default": None, "small": SMALL_TILE, "wide": WIDE_TILE}[tile]
    for weight_layout in (True, False):
        a = torch.randn(m, k, device="cuda", dtype=dtype)
        b = (torch.randn(n, k, device="cuda", dtype=dtype).t() if weight_layout
             else torch.randn(k, n, device="cuda", dtype=dtype))
        bias = torch.randn(n, device="cuda", dtype=dtype)
        out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
        tileweave.matmul(a, b, bias=bias, out=out, config=config)
        assert _rel(out, a.double() @ b.double() + bias.double()) < TOL[dtype]
        again = tileweave.matmul(a, b, bias=bias, config=config)
        assert torch.equal(out, again)


@needs_gpu
@pytest.mark.parametrize("with_bias", [True, False])
def test_matmul_replayed_launch_follows_each_calls_tensors_gpu(with_bias):
    # Later calls of a layout replay the first call's launch plan with the new tensors' addresses
    # (given to the launcher as ints): every call must read its own inputs and write its own output.
    m, n, k = 1024, 768, 4096
    for _ in range(6):
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if with_bias else None
        out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        tileweave.matmul(a, w.t(), bias=bias, out=out)
        ref = a.double() @ w.double().t() + (bias.double() if with_bias else 0)
        assert _rel(out, ref) < TOL[torch.bfloat16]
        # A second tensor set alive at the same time: the plan must not keep the first one's pointers.
        a2 = torch.randn_like(a)
        assert _rel(tileweave.matmul(a2, w.t(), bias=bias), a2.double() @ w.double().t()
                    + (bias.double() if with_bias else 0)) < TOL[torch.bfloat16]


@needs_gpu
@pytest.mark.parametrize("m,n,k", [(1024, 768, 4096), (2048, 1280, 8192), (333, 517, 2048), (4096, 4096, 512)])
def test_stream_k_matmul_gpu(m, n, k):
    from tileweave.tune.configs import STREAM_K_CONFIG

    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    first = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    tileweave.matmul(a, w.t(), bias=bias, out=first, config=STREAM_K_CONFIG)
    assert _rel(first, a.double() @ w.double().t() + bias.double()) < TOL[torch.bfloat16]
    # Back to back without a host sync: each call must find the arrival counts the last one left at zero.
    outs = [tileweave.matmul(a, w.t(), bias=bias, config=STREAM_K_CONFIG) for _ in range(50)]
    assert all(torch.equal(first, o) for o in outs), "stream-K must be bitwise repeatable"
    # Captured in a CUDA graph (its own workspace, zeroed in the graph) and replayed.
    static = torch.empty_like(first)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        tileweave.matmul(a, w.t(), bias=bias, out=static, config=STREAM_K_CONFIG)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        static.fill_(float("nan"))
        graph.replay()
        assert torch.equal(static, first)


C = scenarios.Case


@needs_two
@pytest.mark.parametrize("transport", ["mesh", "ring", "chunked", "oneshot"])
def test_all_gather_gemm_gpu(transport):
    t = transport
    cases = [C(m_chunk=1000, k=1000, n=3000, dtype="bfloat16", bias=True, iters=3, ag_transport=t),
             C(m_chunk=512, k=1001, n=640, dtype="float16", weight_layout=False, iters=2, ag_transport=t),
             C(m_chunk=4096, k=4096, n=7168, dtype="bfloat16", iters=3, ag_transport=t),
             C(m_chunk=2048, k=4096, n=3072, dtype="bfloat16", iters=2, straggler=1, delay_s=0.05,
               ag_transport=t)]
    for rank_rows in run_ranks(RANKS, scenarios.all_gather_gemm_check, cases, gpus=True):
        for row in rank_rows:
            assert row["path"] == (t if t in ("chunked", "oneshot") else "fused"), row
            assert row["err"] < TOL[getattr(torch, row["case"]["dtype"])], row
            assert row["gathered_exact"], row


@needs_two
@pytest.mark.parametrize("transport", ["mesh", "ring"])
def test_all_gather_gemm_stream_k_tail_gpu(transport):
    # Shapes whose partial last wave lies in the last chunk at two ranks on 132 SMs: 128 x 128 tiles,
    # 192 a chunk, 120 shared by K steps (M and K not tile multiples, bias); 128 x 256 tiles, 160 a
    # chunk, 56 shared; a late producer.
    if RANKS != 2 or torch.cuda.get_device_properties(0).multi_processor_count != 132:
        pytest.skip("shapes chosen for two ranks of 132 SMs")
    cases = [C(m_chunk=1000, k=1000, n=3000, dtype="bfloat16", bias=True, iters=3, ag_transport=transport),
             C(m_chunk=1024, k=8192, n=5120, dtype="bfloat16", iters=3, ag_transport=transport),
             C(m_chunk=1024, k=8192, n=5120, dtype="bfloat16", iters=2, straggler=1, delay_s=0.05,
               ag_transport=transport)]
    for rank_rows in run_ranks(2, scenarios.all_gather_stream_k_check, cases, 0, gpus=True):
        for row in rank_rows:
            assert row["path"] == "fused" and row["stream_k"] and row["counts_clear"], row
            assert row["err"] < TOL[torch.bfloat16], row
            assert row["gathered_exact"], row


@needs_two
@pytest.mark.parametrize("transport,graphable", [("mesh", False), ("ring", False), ("chunked", False),
                                                 ("mesh", True)])
def test_returned_gathered_view_outlives_a_peer_running_ahead_gpu(transport, graphable):
    for intact in run_ranks(RANKS, scenarios.lent_gathered_check, transport, graphable,
                            gpus=True):
        assert intact == [True] * 3


@needs_two
def test_all_gather_transport_switches_per_shape_gpu():
    # transport="auto" with the choice made by output width: consecutive calls alternate between the
    # chunked transport and the kernel on one workspace, back to back, a straggler included.
    cases = [C(m_chunk=1024, k=4096, n=1536, dtype="bfloat16", bias=True),
             C(m_chunk=2048, k=4096, n=3072, dtype="bfloat16", straggler=1, delay_s=0.05)]
    for rank_rows in run_ranks(RANKS, scenarios.all_gather_auto_transport_check, cases, 4, 2048,
                               gpus=True):
        assert [r["path"] for r in rank_rows] == ["chunked", "fused"] * 4
        for row in rank_rows:
            assert row["err"] < TOL[torch.bfloat16] and row["gathered_exact"], row


@needs_two
@pytest.mark.parametrize("kind", ["ag-mesh", "ag-ring", "ag-chunked", "rs-chunked"])
def test_graphable_ops_in_a_cuda_graph_gpu(kind):
    for result in run_ranks(RANKS, scenarios.cuda_graph_fused_gpu_check, kind, gpus=True,
                            timeout_s=300):
        assert result["path"] == ("chunked" if kind.endswith("chunked") else "fused"), result
        assert result["err"] < TOL[torch.bfloat16], result


@needs_two
def test_all_gather_stream_k_tail_in_a_cuda_graph_gpu():
    # 2 ranks of 132 SMs, 1024 x 5120 tiles of 128 x 256 a chunk: 320 tiles, 56 shared by K steps; the
    # tail's partials and counts in the graph's own buffers.
    if RANKS != 2 or torch.cuda.get_device_properties(0).multi_processor_count != 132:
        pytest.skip("shape chosen for two ranks of 132 SMs")
    for result in run_ranks(2, scenarios.cuda_graph_fused_gpu_check, "ag-mesh", 1024, 2048, 5120, True, gpus=True,
                            timeout_s=300):
        assert result["path"] == "fused" and result["stream_k"], result
        assert result["err"] < TOL[torch.bfloat16], result


@needs_two
def test_tp_mlp_forward_in_a_cuda_graph_gpu():
    # TILEWEAVE_GRAPHABLE=1: the TP layers' shared ops take their fused (chunked) paths inside the graph.
    # Two ranks: the sizes are chosen so that "auto" takes both chunked transports at TP=2.
    for result in run_ranks(2, scenarios.tp_mlp_graph_gpu_check, gpus=True, timeout_s=300,
                            env={"TILEWEAVE_GRAPHABLE": "1"}):
        assert result["graphable"] and result["paths"] == "chunked,chunked", result
        assert result["err"] < 2e-2, result


@pytest.mark.skipif(not SHARED, reason="for ranks that share a GPU (TILEWEAVE_GPU_RANKS above the GPU count)")
def test_ranks_sharing_a_gpu_are_refused_with_a_clear_error_gpu():
    for message in run_ranks(RANKS, scenarios.shared_gpu_refused_check, gpus=True):
        assert "use the same GPU" in message and "one GPU per rank" in message, message


@needs_two
@pytest.mark.parametrize("op_kind", ["ag", "ag_oneshot", "rs_oneshot"])
def test_missing_peer_reported_by_the_next_call_gpu(op_kind):
    # Without debug mode no call waits for its kernel: the expired wait of the second call must surface
    # as an error in the third, from the error word mirrored to the host (the one-shot paths: written by
    # their kernel into pinned host memory).
    # Ranks that share a GPU take turns on it: a present peer may wait longer there than 2^16 polls.
    outcomes = run_ranks(RANKS, scenarios.missing_peer_check, 1 << (20 if SHARED else 16), op_kind, gpus=True,
                         timeout_s=300)
    assert outcomes[0]["raised"] and outcomes[0]["calls"] == 1, outcomes[0]
    assert "rank 1" in outcomes[0]["message"], outcomes[0]


@needs_two
@pytest.mark.parametrize("transport", ["chunked", "chunked-pull", "oneshot"])
def test_gemm_reduce_scatter_gpu(transport):
    transport, pull = transport.split("-")[0], transport.endswith("pull")
    if pull and RANKS != 2:
        pytest.skip("pull=True takes effect in a group of two")
    cases = [C(m_chunk=1000, k=1000, n=3000, dtype="bfloat16", bias=True, iters=3, transport=transport, pull=pull),
             C(m_chunk=512, k=1001, n=640, dtype="float16", weight_layout=False, iters=2, transport=transport,
               pull=pull),
             C(m_chunk=4096, k=4096, n=4096, dtype="bfloat16", iters=3, transport=transport,
               straggler=1, delay_s=0.05, pull=pull)]
    for rank_rows in run_ranks(RANKS, scenarios.gemm_reduce_scatter_check, cases, gpus=True):
        for row in rank_rows:
            assert row["path"] == ("oneshot" if transport == "oneshot" else "chunked"), row
            assert row["err"] < TOL[getattr(torch, row["case"]["dtype"])], row
            assert row["deterministic"], row


@needs_two
@pytest.mark.parametrize("transport", ["chunked", "oneshot"])
def test_back_to_back_without_sync(transport):
    # The calls after the first repeat a decided signature: they take the repeat route, which must run
    # the path the first call decided (tileweave.last_path after each call) and compute the same op.
    rs_path = {"oneshot": "oneshot", "chunked": "chunked"}.get(transport, "fused")
    for result in run_ranks(RANKS, repeat_paths.back_to_back_paths_check, 1024, 2048, 1536, 12,
                            "bfloat16", transport, gpus=True):
        assert result["worst"]["ag"] < 1e-2 and result["worst"]["rs"] < 1e-2, result
        ag_paths = result["paths"]["ag"]
        assert ag_paths[0] in (("oneshot",) if transport == "oneshot" else ("fused", "chunked")), result
        assert ag_paths == [ag_paths[0]] * 12, result
        assert result["paths"]["rs"] == [rs_path] * 12, result


@needs_two
def test_tp_mlp_layers_gpu():
    # fp32 (TF32 off by default in torch.matmul, ieee in our kernel) and bf16 autocast.
    for result in run_ranks(RANKS, scenarios.tp_mlp_check, 4096, 1024, 4096, True, gpus=True):
        for key in ("y", "dx", "d_up_w", "d_up_b", "d_down_w", "d_down_b"):
            assert result[key] < 1e-4, (key, result)
    for result in run_ranks(RANKS, scenarios.tp_mlp_check, 4096, 1024, 4096, False, True,
                            gpus=True):
        assert result["grad_dtypes"] == "torch.float32,torch.float32", result
        for key in ("y", "dx", "d_up_w", "d_down_w"):
            assert result[key] < 3e-2, (key, result)


@needs_two
@pytest.mark.parametrize("policy", ["fused", "fallback"])
def test_tp_block_gpu(policy):
    for result in run_ranks(RANKS, scenarios.tp_block_check, 2, 64, policy, gpus=True):
        # The fused policy runs the default transports: AG's "auto" takes the chunked one at these small
        # shapes (under CHUNKED_BELOW_GFLOP_AG), RS's default is chunked.
        assert result.pop("paths") == {"fused": "chunked,chunked", "fallback": "fallback,fallback"}[policy]
        for key, err in result.items():
            assert err < 1e-4, (key, result)


@needs_two
@needs_own_gpus
def test_block_benchmark_variants_gpu():
    for result in run_ranks(RANKS, scenarios.block_bench_gpu_check, 4096, gpus=True):
        assert result["ours"] < 1e-2 and result["torch"] < 1e-2, result  # the benchmark's own bound


@needs_two
@needs_own_gpus
def test_unfused_path_in_a_cuda_graph_gpu():
    for result in run_ranks(RANKS, scenarios.cuda_graph_unfused_gpu_check, gpus=True):
        assert result["paths"] == "fallback,fallback" and result["err"] < 1e-2, result


@needs_two
@pytest.mark.parametrize("fp8", [False, True])
def test_all_gather_alone_reads_sources_the_caller_dropped_gpu(fp8):
    # The copies of a gather in flight read the shard and its scales after the caller let go of them.
    for exact in run_ranks(RANKS, scenarios.dropped_sources_check, fp8, gpus=True):
        assert exact == [True] * 4
