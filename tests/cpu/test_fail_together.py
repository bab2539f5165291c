"""Every rank fails together: a bad argument on one rank only makes every rank raise the same error, at
the same call and within a bounded wait, and the next good call is right (against float64 references
computed here from the unsharded problem). Also: unchecked out-of-range routing ids raise, ids other than
int32/int64 are refused by name, bfloat16 is refused on the CPU, and a missing peer of ``moe_plan`` is
reported; and the guarantee of the exchange itself. Two emulated ranks (three for the exchange), small
shapes."""

from __future__ import annotations

import time

import pytest
import torch

import tileweave
from tileweave.nn import TPMoE
from tileweave.ops import common
from tileweave.ops.moe import MoEAllGatherGemm, MoEGemmReduceScatter, moe_plan
from tileweave.testing.emulated import run_ranks

pytestmark = pytest.mark.xdist_group("fail_together")  # its module fixtures built once (scripts/test.sh)

WORLD = 2
TC, K, E, HID, F_LOC = 4, 2, 4, 16, 8  # tokens per rank, top-k, experts, hidden, expert width per rank
FP32_TOL = 1e-5
BOUND_S = 90


def _problem(seed: int) -> dict:
    """The unsharded MoE pair in float32, the same on every rank (a fixed seed)."""
    g = torch.Generator().manual_seed(seed)
    tokens = TC * WORLD
    return {"x": torch.randn(tokens, HID, generator=g), "ids": torch.randint(0, E, (tokens, K), generator=g),
            "wt": torch.rand(tokens, K, generator=g),
            "w0": [torch.randn(E, HID, F_LOC, generator=g) for _ in range(WORLD)],
            "w1": [torch.randn(E, F_LOC, HID, generator=g) for _ in range(WORLD)]}


def _reference(p: dict) -> torch.Tensor:
    """float64 ``[T, H]``: sum over ranks r and slots j of ``wt[t, j] * (x[t] @ w0_r[e]) @ w1_r[e]``,
    ``e = ids[t, j]``, token by token."""
    out = torch.zeros(TC * WORLD, HID, dtype=torch.float64)
    for t in range(TC * WORLD):
        for j in range(K):
            e = int(p["ids"][t, j])
            for r in range(WORLD):
                h = p["x"][t].double() @ p["w0"][r][e].double()
                out[t] += p["wt"][t, j].double() * (h @ p["w1"][r][e].double())
    return out


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).norm() / ref.norm()).item()


def _outcome(fn) -> dict:
    start = time.monotonic()
    try:
        fn()
        raised = None
    except (TypeError, ValueError, tileweave.TileweaveError) as exc:
        raised = (type(exc).__name__, str(exc))
    return {"raised": raised, "seconds": time.monotonic() - start}


def moe_cases(rank: int, world: int) -> dict:
    """Each case: a bad call (bad on rank 1 only unless said), its outcome, then a good pair's error."""
    layer0, layer1 = MoEAllGatherGemm(policy="fused"), MoEGemmReduceScatter(policy="fused")
    mine = slice(rank * TC, (rank + 1) * TC)
    p = _problem(33)
    ref = _reference(p)
    x, ids, wt, w0, w1 = p["x"][mine], p["ids"][mine], p["wt"][mine], p["w0"][rank], p["w1"][rank]
    bad = rank == 1

    def pair(x=x, w0=w0, w1=w1, wt=wt, ids=ids, validate=True):
        plan = moe_plan(ids, num_experts=E, validate=validate)
        out = torch.full((TC, HID), float("nan"))
        layer1(layer0(x, w0, plan), w1, plan, wt, out=out)
        return out

    def with_id(value):
        if not bad:
            return ids
        changed = ids.clone()
        changed[1, 0] = value
        return changed

    agreed = moe_plan(ids, num_experts=E)
    cases = {
        "plan_id_high": lambda: moe_plan(with_id(E), num_experts=E),
        "plan_ids_int16": lambda: moe_plan(ids.to(torch.int16) if bad else ids, num_experts=E),
        "plan_ids_uint8_everywhere": lambda: moe_plan(ids.to(torch.uint8), num_experts=E),
        "plan_k_differs": lambda: moe_plan(ids[:, :1] if bad else ids, num_experts=E),
        "unchecked_id_E": lambda: pair(ids=with_id(E), validate=False),
        "unchecked_id_minus_1": lambda: pair(ids=with_id(-1), validate=False),
        "unchecked_id_1e6": lambda: pair(ids=with_id(10 ** 6), validate=False),
        "layer0_w0_hidden": lambda: layer0(x, w0[:, :HID - 1] if bad else w0, agreed),
        "layer0_f_loc_after_agreed": lambda: layer0(x, torch.randn(E, HID, F_LOC + 8) if bad else w0, agreed),
        "layer1_weights_shape": lambda: pair(wt=wt[:, :1] if bad else wt),
        "layer1_weights_none": lambda: pair(wt=None if bad else wt),
        "layer1_weights_dtype": lambda: pair(wt=wt.to(torch.int64) if bad else wt),
        "layer1_h_rows_after_agreed": lambda: layer1(torch.randn(TC * WORLD * K - bad, F_LOC), w1, agreed, wt),
    }
    first = _rel(pair(), ref[mine])  # every op's first call: the signature met before every bad call
    results = {"first": first}
    for name, bad_call in cases.items():
        outcome = _outcome(bad_call)
        outcome["after"] = _rel(pair(), ref[mine])
        results[name] = outcome
    return results


@pytest.fixture(scope="module")
def moe_outcomes():
    return run_ranks(WORLD, moe_cases)


def _check_together(per_rank: list, name: str, kind: str, *texts: str) -> None:
    """Every rank raised the same ``kind`` of error with the same message (holding ``texts``), within
    the bound, and the good call after it was right."""
    outcomes = [results[name] for results in per_rank]
    for outcome in outcomes:
        assert outcome["raised"] is not None, (name, outcome)
        assert outcome["raised"][0] == kind, (name, outcome)
        assert outcome["seconds"] < BOUND_S, (name, outcome)
        assert outcome["after"] < FP32_TOL, (name, outcome)
        for text in texts:
            assert text in outcome["raised"][1], (name, outcome)
    assert all(outcome["raised"] == outcomes[0]["raised"] for outcome in outcomes), (name, outcomes)


def test_moe_pair_is_right_before_the_bad_calls(moe_outcomes):
    assert all(results["first"] < FP32_TOL for results in moe_outcomes), moe_outcomes


def test_out_of_range_id_on_one_rank_raises_on_every_rank(moe_outcomes):
    _check_together(moe_outcomes, "plan_id_high", "ValueError", "topk_ids_shard of rank 1 holds expert id 4",
                    "outside [0, num_experts=4)")


@pytest.mark.parametrize("name", ["unchecked_id_E", "unchecked_id_minus_1", "unchecked_id_1e6"])
def test_unchecked_out_of_range_id_raises_through_the_error_word(moe_outcomes, name):
    _check_together(moe_outcomes, name, "ValueError", "moe_all_gather_gemm", "1 expert id(s) outside [0, num_experts)")


def test_int16_and_uint8_ids_are_refused_by_name(moe_outcomes):
    _check_together(moe_outcomes, "plan_ids_int16", "TypeError", "topk_ids_shard has dtype torch.int16",
                    "int32 or int64", "rank 1")
    _check_together(moe_outcomes, "plan_ids_uint8_everywhere", "TypeError", "topk_ids_shard has dtype torch.uint8")


@pytest.mark.parametrize("name,kind,texts", [
    ("plan_k_differs", "TileweaveError", ("every rank must route",)),
    ("layer0_w0_hidden", "ValueError", ("w0 is [4, 15, 8]", "rank 1")),
    ("layer1_weights_shape", "ValueError", ("topk_weights_shard must be [T/W, k]", "rank 1")),
    ("layer1_weights_none", "TileweaveError", ("every rank of the group must pass the same",)),
    ("layer1_weights_dtype", "TypeError", ("topk_weights_shard has dtype torch.int64",)),
])
def test_a_bad_argument_on_one_rank_raises_on_every_rank(moe_outcomes, name, kind, texts):
    _check_together(moe_outcomes, name, kind, *texts)


@pytest.mark.parametrize("name,kind,text", [
    ("layer0_f_loc_after_agreed", "TileweaveError", "every rank of the group must pass the same"),
    ("layer1_h_rows_after_agreed", "ValueError", "h has 15 rows"),
])
def test_moe_ranks_that_disagree_after_an_agreed_call_raise_together(moe_outcomes, name, kind, text):
    _check_together(moe_outcomes, name, kind, text)


def all_reduce_cases(rank: int, world: int) -> dict:
    """gemm_all_reduce: a call every rank agrees on, then bad calls on rank 1 only, each followed by a
    good call (against float64)."""
    g = torch.Generator().manual_seed(7)
    m, k, n = 4, 8, 12
    a_all = [torch.randn(m, k, generator=g) for _ in range(world)]
    b_all = [torch.randn(k, n, generator=g) for _ in range(world)]
    residual = torch.randn(m, n, generator=g)
    ref = sum(a.double() @ b.double() for a, b in zip(a_all, b_all)) + residual.double()
    op = tileweave.GemmAllReduce(policy="oneshot")
    a, b = a_all[rank], b_all[rank]
    bad = rank == 1
    cases = {
        "residual_none": lambda: op(a, b, residual=None if bad else residual),
        "residual_shape": lambda: op(a, b, residual=residual[:, :n - 1] if bad else residual),
        "m_after_agreed": lambda: op(torch.randn(m + 2 * bad, k), b, residual=torch.randn(m + 2 * bad, n)),
    }
    results = {"first": _rel(op(a, b, residual=residual), ref)}
    for name, bad_call in cases.items():
        outcome = _outcome(bad_call)
        outcome["after"] = _rel(op(a, b, residual=residual), ref)
        results[name] = outcome
    return results


@pytest.mark.parametrize("name,kind,text", [
    ("residual_none", "TileweaveError", "every rank of the group must pass the same"),
    ("residual_shape", "ValueError", "residual must have shape (4, 12)"),
    ("m_after_agreed", "TileweaveError", "every rank of the group must pass the same"),
])
def test_gemm_all_reduce_fails_together(name, kind, text, all_reduce_outcomes):
    assert all(results["first"] < FP32_TOL for results in all_reduce_outcomes)
    _check_together(all_reduce_outcomes, name, kind, text)


@pytest.fixture(scope="module")
def all_reduce_outcomes():
    return run_ranks(WORLD, all_reduce_cases)


def bf16_cases(rank: int, world: int) -> dict:
    """bfloat16 into each MoE op, TPMoE and (for its message) the dense AllGather+GEMM, every rank alike."""
    bf = torch.bfloat16
    mine = slice(rank * TC, (rank + 1) * TC)
    p = _problem(5)
    plan = moe_plan(p["ids"][mine], num_experts=E)
    x, w0, w1 = p["x"][mine].to(bf), p["w0"][rank].to(bf), p["w1"][rank].to(bf)
    layer = TPMoE(HID, F_LOC * world, E, K, dtype=bf)
    outcomes = {
        "dense": _outcome(lambda: tileweave.AllGatherGemm()(x, w0[0])),
        "layer0": _outcome(lambda: MoEAllGatherGemm()(x, w0, plan)),
        "layer1": _outcome(lambda: MoEGemmReduceScatter()(torch.randn(TC * world * K, F_LOC).to(bf), w1, plan,
                                                          p["wt"][mine])),
        "tp_moe": _outcome(lambda: layer(x)),
    }
    with torch.no_grad():
        outcomes["tp_moe_no_grad"] = _outcome(lambda: layer(x))
    return outcomes


def test_bf16_on_the_cpu_is_refused_with_the_dense_message():
    assert common.interpreting()
    for outcomes in run_ranks(WORLD, bf16_cases):
        kind, dense = outcomes.pop("dense")["raised"]
        assert kind == "TypeError" and "is bfloat16" in dense, dense
        reason = dense.split(" is bfloat16", 1)[1]
        for name, outcome in outcomes.items():
            assert outcome["raised"] is not None, (name, outcome)
            assert outcome["raised"][0] == "TypeError" and outcome["raised"][1].endswith(reason), (name, outcome)


def missing_plan_peer(rank: int, world: int) -> dict:
    """Rank 0 calls moe_plan while rank 1 does not; then both call it (the next good call)."""
    ids = _problem(9)["ids"][rank * TC:(rank + 1) * TC]
    outcome = _outcome(lambda: moe_plan(ids, num_experts=E)) if rank == 0 else None
    torch.distributed.barrier()
    plan = moe_plan(ids, num_experts=E)
    return {"outcome": outcome, "after": plan.offsets.tolist()}


def test_moe_plan_reports_a_missing_peer_within_the_bound():
    host_timeout_s = 5
    results = run_ranks(WORLD, missing_plan_peer, env={"TILEWEAVE_EMULATED_TIMEOUT_S": str(host_timeout_s)})
    outcome = results[0]["outcome"]
    assert outcome["raised"] is not None and outcome["raised"][0] == "CollectiveTimeout", outcome
    assert "rank 1" in outcome["raised"][1] and "expired" in outcome["raised"][1], outcome
    assert host_timeout_s <= outcome["seconds"] < 4 * host_timeout_s, outcome
    assert results[0]["after"] == results[1]["after"]


def exchange_guarantee(rank: int, world: int) -> dict:
    """Many exchanges with rank-specific records (every rank must get every rank's record of the same
    exchange, never one of an earlier or later one), one where the ranks are in different ops, then more."""
    from tileweave.runtime.agreement import exchange

    group = torch.distributed.group.WORLD
    wrong = [exchange(group, rank, world, "op", (i, rank), timeout_s=60) != [(i, r) for r in range(world)]
             for i in range(300)]
    outcome = _outcome(lambda: exchange(group, rank, world, f"op{rank % 2}", None, timeout_s=60))
    after = exchange(group, rank, world, "op", rank, timeout_s=60)
    return {"wrong": sum(wrong), "outcome": outcome, "after": after}


def test_exchange_gives_every_rank_the_records_of_the_same_exchange():
    results = run_ranks(3, exchange_guarantee)
    for result in results:
        assert result["wrong"] == 0, result
        assert result["outcome"]["raised"] == results[0]["outcome"]["raised"], results
        assert result["outcome"]["raised"][0] == "TileweaveError", result
        assert "rank 0 op0, rank 1 op1, rank 2 op0" in result["outcome"]["raised"][1], result
        assert result["after"] == [0, 1, 2], result
