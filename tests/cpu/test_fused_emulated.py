"""The fused ops on emulated ranks: W CPU processes sharing a symmetric heap, each running the real
Triton kernels in the interpreter while a producer thread moves data and writes flags concurrently.
References are float64 products of the full, unsharded inputs (``support.scenarios``)."""

import dataclasses
import random

import pytest

import tileweave
from tileweave.runtime.emulated import ONE_QUEUE_ENV
from support import scenarios
from tileweave.testing.emulated import run_ranks

C = scenarios.Case
TOL = {"float16": 2e-3, "float32": 1e-5}


def _check(rows_per_rank, extra_key):
    for rows in rows_per_rank:
        for row in rows:
            chunked = "chunked" in (row["case"]["transport"], row["case"]["ag_transport"])
            oneshot = "oneshot" in (row["case"]["transport"], row["case"]["ag_transport"])
            expected = "oneshot" if oneshot else "chunked" if chunked else "fused"
            assert row["path"] == expected, row
            assert row["err"] < TOL[row["case"]["dtype"]], row
            assert row[extra_key], row


def _three_cases(late: C, world: int, **transport) -> list[C]:
    """The cases both ops take, each with the ``transport`` settings given: rows not a tile multiple,
    with bias; odd M in float32 with a row-major b (K not a TMA pitch); ``late``, called twice, the
    last rank late by its ``delay_s``."""
    return [C(m_chunk=40, k=48, n=56, bias=True, iters=2, **transport),
            C(m_chunk=17, k=24, n=40, dtype="float32", weight_layout=False, **transport),
            dataclasses.replace(late, iters=2, straggler=world - 1, **transport)]


AG_LATE = C(m_chunk=32, k=64, n=32, delay_s=0.3)
"""A late producer."""
RS_LATE = C(m_chunk=150, k=32, n=24, delay_s=0.2)
"""More rows than one row group (2 x 32 here): several copies and arrival flags per peer."""


@pytest.mark.parametrize("world", [2])  # four ranks: the chunked and one-shot cases below; eight: further down
def test_all_gather_gemm(world):
    _check(run_ranks(world, scenarios.all_gather_gemm_check, _three_cases(AG_LATE, world)), "gathered_exact")


@pytest.mark.parametrize("world,transport", [(4, "chunked"), (2, "oneshot"), (3, "oneshot")])
def test_all_gather_gemm_chunked_and_oneshot(world, transport):
    # cuBLAS per shard as the shards arrive (chunked), or the peers' shards copied out of their gather
    # buffers by one kernel and then one GEMM (the one-shot path); odd calls fill a caller's gathered_out.
    cases = _three_cases(AG_LATE, world, ag_transport=transport)
    _check(run_ranks(world, scenarios.all_gather_gemm_check, cases), "gathered_exact")


@pytest.mark.parametrize("world,programs", [(4, 3), (3, 4)])
def test_all_gather_gemm_stream_k_tail(world, programs):
    # The last chunk's tiles of the partial wave shared by K steps over every program: 4 ranks, 4 tiles
    # of 32 x 32 a chunk on 3 programs leave 1 (seven K steps each at K=200); 3 ranks (ring), 6 tiles a
    # chunk on 4 programs, leave 2. Late producers, bias, a K that TMA cannot take.
    ring = world == 3
    wider = 32 if ring else 0
    cases = [C(m_chunk=40, k=200, n=56 + wider, bias=True, iters=2),
             C(m_chunk=64, k=96, n=48 + wider, iters=2, straggler=world - 1, delay_s=0.3),
             C(m_chunk=40, k=130, n=56 + wider, dtype="float32", weight_layout=False)]
    cases = [dataclasses.replace(c, ag_transport="ring" if ring else "mesh") for c in cases]
    rows = run_ranks(world, scenarios.all_gather_stream_k_check, cases, programs)
    _check(rows, "gathered_exact")
    for per_rank in rows:
        for row in per_rank:
            assert row["stream_k"] and row["counts_clear"], row


@pytest.mark.parametrize("world,transport,graphable", [(2, "mesh", False), (3, "ring", False),
                                                       (3, "chunked", False), (2, "chunked", True)])
def test_returned_gathered_view_outlives_a_peer_running_ahead(world, transport, graphable):
    # Rank 0 holds each returned gathered input while the peers start their next call: their shards
    # must not land in the buffer before rank 0's next call (a graphable op returns a fresh tensor).
    for intact in run_ranks(world, scenarios.lent_gathered_check, transport, graphable):
        assert intact == [True] * 3


@pytest.mark.parametrize("world", [2, 3])
def test_all_gather_transport_switches_per_shape(world):
    # transport="auto" chooses per shape: calls alternate between the chunked transport (n < 48) and the
    # kernel on one workspace, a straggler included.
    cases = [C(m_chunk=24, k=32, n=40, bias=True), C(m_chunk=40, k=48, n=56, straggler=world - 1, delay_s=0.2)]
    rows = run_ranks(world, scenarios.all_gather_auto_transport_check, cases, 3, 48)
    for per_rank in rows:
        assert [r["path"] for r in per_rank] == ["chunked", "fused"] * 3
        for r in per_rank:
            assert r["err"] < TOL[r["case"]["dtype"]] and r["gathered_exact"], r


@pytest.mark.parametrize("world", [3])  # every step of the two-rank protocol, with one peer more
def test_all_gather_gemm_graphable(world):
    # Constant-valued flags (what a CUDA-graph replay repeats), eager here: fresh inputs call after
    # call, both transports, a late producer.
    cases = [
        C(m_chunk=40, k=48, n=56, bias=True, iters=2, graphable=True),
        C(m_chunk=32, k=64, n=32, iters=2, straggler=world - 1, delay_s=0.3, graphable=True),
        C(m_chunk=17, k=24, n=40, dtype="float32", iters=2, ag_transport="chunked", graphable=True),
        C(m_chunk=32, k=64, n=32, iters=2, straggler=0, delay_s=0.3, ag_transport="chunked", graphable=True),
    ]
    _check(run_ranks(world, scenarios.all_gather_gemm_check, cases), "gathered_exact")


def test_graphable_transport_switches_and_gathers_alone():
    # One graphable op whose calls alternate between the chunked transport and the kernel, then its
    # gather alone interleaved with calls: one set of 0/1 flags throughout.
    cases = [C(m_chunk=24, k=32, n=40, bias=True), C(m_chunk=40, k=48, n=56, straggler=2, delay_s=0.2)]
    rows = run_ranks(3, scenarios.all_gather_auto_transport_check, cases, 3, 48, True)
    for per_rank in rows:
        assert [r["path"] for r in per_rank] == ["chunked", "fused"] * 3
        for r in per_rank:
            assert r["err"] < TOL[r["case"]["dtype"]] and r["gathered_exact"], r
    for result in run_ranks(2, scenarios.all_gather_only_check, "mesh", 3, 1, True):
        assert result["exact"] and result["fused_err"] < TOL["float16"], result


@pytest.mark.parametrize("world", [3])  # more hops: the eight-rank ring below
def test_all_gather_gemm_ring_graphable(world):
    # The ring on 0/1 flags: each forward waits for its own READY word, which is reset only after the
    # copy stream is joined; a late rank delays every chunk that passes through it.
    cases = [C(m_chunk=40, k=48, n=56, bias=True, iters=2, ag_transport="ring", graphable=True),
             C(m_chunk=24, k=32, n=40, iters=3, straggler=1, delay_s=0.2, ag_transport="ring", graphable=True)]
    _check(run_ranks(world, scenarios.all_gather_gemm_check, cases), "gathered_exact")


@pytest.mark.parametrize("setting, value, error", [
    ("policy", "fast", ValueError), ("transport", "nvlink", ValueError), ("max_spin", 0, ValueError),
    ("max_spin", 1 << 31, ValueError), ("max_spin", 1.5, ValueError), ("max_spin", True, ValueError),
    ("config", {"block_m": 64}, TypeError)])
def test_a_bad_setting_is_refused_by_name_in_the_constructor_and_later(setting, value, error):
    with pytest.raises(error, match=setting):
        tileweave.GemmReduceScatter(**{setting: value})
    op = tileweave.AllGatherGemm()
    before = getattr(op, setting)
    with pytest.raises(error, match=setting):
        setattr(op, setting, value)
    assert getattr(op, setting) == before  # a refused value leaves the setting as it was


def test_a_graphable_op_refuses_to_pull_when_set_later():
    op = tileweave.GemmReduceScatter(graphable=True)
    assert op.pull is False
    with pytest.raises(tileweave.TileweaveError, match="pull"):
        op.pull = True


@pytest.mark.parametrize("world", [3])  # every step of the two-rank protocol, with one peer more
def test_gemm_reduce_scatter_graphable(world):
    # The chunked transport on constant-valued flags: several blocks per owner, fresh inputs each call,
    # a late producer; still bitwise repeatable.
    cases = [
        C(m_chunk=40, k=48, n=56, bias=True, iters=2, transport="chunked", graphable=True),
        C(m_chunk=150, k=32, n=24, iters=2, transport="chunked", chunk_rows=32, straggler=world - 1,
          delay_s=0.2, graphable=True),
    ]
    _check(run_ranks(world, scenarios.gemm_reduce_scatter_check, cases), "deterministic")


@pytest.mark.parametrize("world", [3])  # more hops: the eight-rank ring below
def test_all_gather_gemm_ring(world):
    # Each chunk is forwarded hop by hop; a late rank delays every chunk that passes through it.
    cases = [
        C(m_chunk=40, k=48, n=56, bias=True, iters=3, ag_transport="ring"),
        C(m_chunk=24, k=32, n=40, iters=2, straggler=1, delay_s=0.2, ag_transport="ring"),
    ]
    _check(run_ranks(world, scenarios.all_gather_gemm_check, cases), "gathered_exact")


@pytest.mark.parametrize("world,transport", [(4, "chunked"), (2, "oneshot"), (3, "oneshot")])
def test_gemm_reduce_scatter(world, transport):
    cases = _three_cases(RS_LATE, world, transport=transport)
    _check(run_ranks(world, scenarios.gemm_reduce_scatter_check, cases), "deterministic")


@pytest.mark.parametrize("world, transport", [(3, "ring"), (4, "mesh")])
def test_all_gather_alone_on_the_copy_engines(world, transport):
    for result in run_ranks(world, scenarios.all_gather_only_check, transport, 3, world - 1):
        assert result["exact"], result
        assert result["fused_err"] < TOL["float16"], result


def test_all_gather_alone_holds_its_sources_until_release():
    # The copies of a gather in flight read the shard and scales after the caller let go of them: the
    # call keeps them alive until release(), and not after.
    for result in run_ranks(2, scenarios.gather_holds_sources_check):
        assert result == {"float8": (True, True), "float16": (True, True)}


@pytest.mark.parametrize("world, policy", [(2, "fused"), (2, "fallback"), (1, "fused")])
def test_all_gather_alone_carries_float8_rows_with_their_scales(world, policy):
    # The TP layers regather float8 rows with their scales for a weight gradient; every path keeps both
    # (the ring forwards scales as AllGather+GEMM's float8 calls do, tested in test_fp8_fused).
    for result in run_ranks(world, scenarios.all_gather_only_check, "mesh", 2, world - 1, False, True, policy):
        assert result["exact"], result
        assert result["fused_err"] < TOL["float16"], result
        missing, stray, one_rank = result["refusals"]
        assert "float8 a_shard [7, 256] needs scales" in missing, missing
        assert "scales go with float8 rows" in stray, stray
        assert one_rank != "no error", one_rank  # every rank fails when one rank's scales are wrong


def test_all_gather_gemm_eight_ranks():
    # TP=8 as on an 8-GPU node: rows not a tile multiple, a late producer, on the ring, whose hop order
    # depends on W (the full mesh and the chunked transport are tested at 2-4 ranks).
    cases = [C(m_chunk=12, k=16, n=24, bias=True, iters=1, ag_transport="ring", straggler=5, delay_s=0.1)]
    _check(run_ranks(8, scenarios.all_gather_gemm_check, cases, heap_bytes=4 << 20), "gathered_exact")


def test_gemm_reduce_scatter_eight_ranks():
    transport = "chunked"
    cases = [C(m_chunk=12, k=16, n=24, bias=True, iters=2, transport=transport, straggler=3, delay_s=0.1)]
    _check(run_ranks(8, scenarios.gemm_reduce_scatter_check, cases, heap_bytes=4 << 20), "deterministic")


def test_chunked_reduce_scatter_pulling_into_the_output():
    # Two ranks: each owner's copy stream pulls the peer's row blocks straight into its output, and
    # the own GEMM adds onto them in place. Several blocks, bias, a late rank (its pulls delayed), fresh
    # inputs each call on one workspace, then one block (pulled into a private buffer while the own
    # GEMM writes the output, then added); bitwise repeatable.
    cases = [C(m_chunk=70, k=24, n=40, bias=True, iters=3, transport="chunked", chunk_rows=16, pull=True,
               straggler=1, delay_s=0.1),
             C(m_chunk=20, k=24, n=40, iters=2, transport="chunked", chunk_rows=16, pull=True),
             C(m_chunk=17, k=24, n=40, dtype="float32", weight_layout=False, transport="chunked", pull=True)]
    for rows in run_ranks(2, scenarios.gemm_reduce_scatter_check, cases):
        _check([rows], "deterministic")
        # Every call's plan pulls (a repeat is bitwise the same as the checked call: "deterministic"
        # compares them from the second call on).
        assert all(r["route"] == "chunked:pull" for r in rows), rows
        # No buffer outside the symmetric one while every call has several blocks; then one block's.
        assert all(r["local_bytes"] == 0 for r in rows if r["case"]["m_chunk"] == 70), rows
        one_block = [r for r in rows if r["case"]["m_chunk"] != 70]
        assert one_block and all(r["local_bytes"] >= 17 * 40 * 4 for r in one_block[-1:]), rows
        assert all(20 * 40 * 2 <= r["local_bytes"] <= 2 * 17 * 40 * 4 for r in one_block), rows
    # An output with padded rows cannot take the pulls: the call pushes, and is still right; so is the
    # one-shot path's.
    for errors in run_ranks(2, scenarios.rs_padded_out_check):
        assert errors["fused"] < TOL["float16"] and errors["oneshot"] < TOL["float16"], errors


def test_reduce_scatter_pulls_by_default_except_in_graphable_ops():
    assert tileweave.GemmReduceScatter().pull and not tileweave.GemmReduceScatter(pull=False).pull
    assert not tileweave.GemmReduceScatter(graphable=True).pull
    with pytest.raises(tileweave.TileweaveError, match="pull=True is not graphable"):
        tileweave.GemmReduceScatter(graphable=True, pull=True)


@pytest.mark.parametrize("op, world, option", [("rs", 2, "push"), ("rs", 3, "push"), ("rs", 2, "pull"),
                                                ("ag", 2, "per_shard"), ("ag", 3, "per_shard")])
def test_chunked_transports_on_one_hardware_queue(op, world, option):
    # Every stream of a rank in one in-order queue (ONE_QUEUE_ENV), as streams that share a hardware
    # queue on a GPU: a stream wait on a peer's flag issued before the work the peer waits for from this
    # rank deadlocks (a pulling order that did so passed the threaded emulation and hung on 2x H200).
    env = {ONE_QUEUE_ENV: "1", "TILEWEAVE_EMULATED_TIMEOUT_S": "15"}
    if op == "rs":
        cases = [C(m_chunk=70, k=24, n=40, bias=True, iters=2, transport="chunked", chunk_rows=16,
                   pull=option == "pull", straggler=world - 1, delay_s=0.05)]
        if option == "pull":  # and with one block per owner (its own issue order)
            cases.append(C(m_chunk=20, k=24, n=40, bias=True, iters=2, transport="chunked", chunk_rows=16,
                           pull=True, straggler=1, delay_s=0.05))
        _check(run_ranks(world, scenarios.gemm_reduce_scatter_check, cases, env=env), "deterministic")
    else:
        cases = [C(m_chunk=40, k=48, n=56, bias=True, iters=2, ag_transport="chunked", straggler=world - 1,
                   delay_s=0.05)]
        _check(run_ranks(world, scenarios.all_gather_gemm_check, cases, env=env), "gathered_exact")


@pytest.mark.parametrize("world", [2, 3])
def test_chunked_reduce_scatter_in_row_blocks(world):
    # Several row blocks per owner (16 rows each here, the last one longer), bias, a late producer,
    # then a shape with fewer blocks on the same workspace.
    cases = [C(m_chunk=70, k=24, n=40, bias=True, iters=2, transport="chunked", chunk_rows=16,
               straggler=world - 1, delay_s=0.1),
             C(m_chunk=20, k=24, n=40, iters=2, transport="chunked", chunk_rows=16)]
    _check(run_ranks(world, scenarios.gemm_reduce_scatter_check, cases), "deterministic")


def test_reduce_scatter_shape_changes_in_one_workspace():
    transport = "chunked"
    # The third shape has more row groups (of 2 x 32 rows) than the second and still fits the
    # workspace sized by the first: every flag it waits for must have been raised by the calls before,
    # whichever groups they used. A short spin budget turns a wait that can never end into a failure.
    cases = [C(m_chunk=150, k=32, n=24, iters=1, transport=transport),
             C(m_chunk=20, k=32, n=24, iters=1, transport=transport),
             C(m_chunk=130, k=16, n=24, iters=2, transport=transport)]
    ranks = run_ranks(2, scenarios.gemm_reduce_scatter_check, cases, env={"TILEWEAVE_MAX_SPIN": "20000"})
    _check(ranks, "deterministic")
    if transport == "chunked":
        # One send buffer for every shape, sized by the largest (W-1 peers' rows of [M/W, N], fp16).
        largest = max((2 - 1) * c.m_chunk * c.n * 2 for c in cases)
        assert all(row["local_bytes"] == largest for rows in ranks for row in rows), ranks


def test_oneshot_reduce_scatter_buffer_grows_between_shapes():
    # Small, larger (the one-shot buffer grows, collectively, after every rank's earlier calls), small
    # again in the grown buffer. A short spin budget turns a wait for a signal that never comes into a
    # failure (so no late rank here: test_gemm_reduce_scatter has one, with the default budget).
    cases = [C(m_chunk=20, k=32, n=24, iters=2, transport="oneshot"),
             C(m_chunk=70, k=16, n=40, iters=3, transport="oneshot", bias=True),
             C(m_chunk=20, k=32, n=24, iters=2, transport="oneshot", seed=1)]
    _check(run_ranks(2, scenarios.gemm_reduce_scatter_check, cases, env={"TILEWEAVE_MAX_SPIN": "20000"}),
           "deterministic")


def test_oneshot_calls_of_changing_shapes_never_write_the_previous_calls_slot():
    # Shapes in random order, shrinking and growing (the buffer grows, collectively, in between): each
    # call's slot of the one-shot buffer lies apart from the previous call's, which a slower peer may
    # still be reading when this rank's next call writes its own.
    rng = random.Random()
    shapes = [(rng.choice([4, 12, 20, 36]), rng.choice([16, 32]), rng.choice([8, 24, 40])) for _ in range(6)]
    for result in run_ranks(2, scenarios.oneshot_slots_check, shapes):
        assert result["err"] < TOL["float16"], (shapes, result)
        for name, calls in result["slots"].items():
            for (base0, start0, end0), (base1, start1, end1) in zip(calls, calls[1:]):
                assert base0 != base1 or end1 <= start0 or end0 <= start1, (name, shapes, calls)


def test_a_changed_setting_takes_effect_on_repeat_calls():
    # Repeat calls take the plan their signature's first call decided; a setting changed after (every
    # rank alike) must replan them: policy, transport, config; the spin bound decides no path, so
    # setting it alone keeps the plans and reaches the one-shot launch plans.
    expected = [("oneshot", "oneshot"), ("fallback", "fallback"), ("chunked", "chunked"), ("fused", "chunked"),
                ("oneshot", "oneshot"), ("oneshot", "oneshot")]
    for rows in run_ranks(2, scenarios.settings_change_check):
        assert [row["paths"] for row in rows] == [paths for paths in expected for _ in range(2)], rows
        for row in rows:
            assert row["err"] < TOL["float16"], row
            if "config" in row["settings"]:  # the fused decisions use the config set, not the agreed default
                assert row["configs"] and all(c == row["settings"]["config"] for c in row["configs"]), row
        assert rows[-3]["spins"] and all(spin == 123_457 for spin in rows[-3]["spins"]), rows[-3]
        assert rows[-1]["spins"] and all(spin == 99_991 for spin in rows[-1]["spins"]), rows[-1]
        assert rows[-2]["plans_kept"] == [["oneshot"], ["oneshot"]], rows[-2]
        assert all(row["plans_kept"] == [[], []] for row in rows[2:8]), rows  # each forgotten on a change


@pytest.mark.parametrize("transport", ["chunked", "oneshot"])
def test_back_to_back_calls_with_changing_inputs(transport):
    for result in run_ranks(2, scenarios.back_to_back_check, 24, 32, 40, 4, "float16", transport):
        assert result["max_ag"] < 2e-3 and result["max_rs"] < 2e-3, result
        # One plan per op, decided by the first call and taken by the others.
        oneshot = transport == "oneshot"
        assert result["plans"] == [["oneshot" if oneshot else "fused"], ["oneshot" if oneshot else "chunked"]], result


@pytest.mark.parametrize("op_kind", ["ag", "ag_oneshot", "rs_oneshot"])
def test_missing_peer_raises_instead_of_hanging(op_kind):
    outcomes = run_ranks(2, scenarios.missing_peer_check, 200, op_kind, timeout_s=120)
    assert outcomes[0]["raised"], "rank 0 waited on data that never came and did not raise"
    assert "rank 1" in outcomes[0]["message"]


def test_bad_inputs_raise_on_every_rank():
    for caught in run_ranks(2, scenarios.input_errors_check):
        assert "divisible" in caught["rs_indivisible_m"], caught
        assert "K=32" in caught["ag_k_mismatch"], caught
        assert "dtype" in caught["ag_dtype_mismatch"], caught
        assert "gathered_out must be" in caught["ag_gathered_out_shape"] and "(16, 32)" in caught["ag_gathered_out_shape"]
        assert "gathered_out must be contiguous" in caught["ag_gathered_out_strided"], caught
        assert "same shapes" in caught["ag_ranks_disagree"], caught


def test_unfused_fallback_paths():
    for result in run_ranks(2, scenarios.fallback_check, 12, 16, 20):
        assert result["ag"] < 1e-5 and result["rs"] < 1e-5 and result["gathered"] == 1.0, result
        assert result["ag_path"] == "fallback" and result["rs_path"] == "fallback"
        for it in range(3):
            assert result[f"ag_repeat{it}"] < 1e-5 and result[f"rs_repeat{it}"] < 1e-5, result
        assert "K=" in result["ag_bad_k"] and "K_loc=" in result["rs_bad_k"], result
        assert "gathered_out must be" in result["ag_bad_gathered_out"], result
        assert "dtype" in result["ag_bad_dtype"] and "dtype" in result["rs_bad_dtype"], result


def test_a_group_without_this_rank_is_refused():
    results = run_ranks(2, scenarios.foreign_group_check)
    assert "not a member of the group" in results[1], results


def test_cuda_graph_capture_rules():
    # Under capture: the unfused path for a signature an eager call agreed on (where the eager call
    # took a fused path with epochs, NCCL instead, as policy "auto" does); the fused paths only on
    # graphable ops, policy "fused" otherwise refused with one message; a first call never.
    for outcomes in run_ranks(2, scenarios.capture_rules_check):
        for name, outcome in outcomes.items():
            policy, call, when = name.split(" ", 2)
            if policy == "oneshot-paths":  # NCCL under capture, then the one-shot path again
                assert outcome == "fallback oneshot", (name, outcome)
            elif policy == "graphable" and when == "after eager":  # constant flags: the fused paths capture
                assert outcome.startswith("ok") and float(outcome.split()[1]) < 1e-5, (name, outcome)
            elif policy == "fused":
                assert outcome.startswith("error") and "cannot be captured" in outcome, (name, outcome)
                assert "graphable=True" in outcome and "policy='auto' or 'fallback'" in outcome, (name, outcome)
            elif when == "before eager":  # the agreement is a collective: never under capture
                assert outcome.startswith("error") and "before capturing" in outcome, (name, outcome)
            else:
                assert outcome.startswith("ok") and float(outcome.split()[1]) < 1e-5, (name, outcome)


def test_ops_refuse_inputs_that_require_grad():
    # Not differentiable: a silent result without a gradient (or torch's error from inside a transport,
    # peers left waiting) would be wrong; the TP layers are the differentiable form.
    for outcomes in run_ranks(2, scenarios.grad_refused_check):
        for name, (error, finite) in outcomes.items():
            assert error is not None and error.startswith(f"{name} is not differentiable"), (name, error)
            assert "grad: call it under torch.no_grad()" in error and finite, (name, error, finite)
