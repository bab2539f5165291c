"""GEMM + AllReduce on emulated ranks against float64 references (support.scenarios.all_reduce):
the one-shot and two-shot kernels in the interpreter with the real flag protocols, and the unfused path."""

import dataclasses

import pytest

from tileweave.ops.all_reduce import choose_path, rule
from support.scenarios import all_reduce as scenarios
from support.scenarios.all_reduce import DecodeCase as C
from tileweave.testing.emulated import run_ranks

EMULATED_SMS = 4  # EmulatedBackend.num_sms


def _check(per_rank):
    """Every call within its tolerance (NaN never passes) into the given ``out``, and bitwise the same
    outputs on every rank."""
    for rows in per_rank:
        for row in rows:
            assert row["err"] < row["tol"], row
            assert row["out_is_y"], row
    for rows in per_rank[1:]:
        assert [row["sums"] for row in rows] == [row["sums"] for row in per_rank[0]]


def _sums(rows, **match):
    return [row["sums"] for row in rows if all(row["case"][key] == value for key, value in match.items())]


def _same_bits_on_both_protocols(rows, policy):
    """Each call of a graphable case gave the bits of the same case's call on the epoch protocol."""
    def calls(graphable):
        return {(tuple(sorted((k, v) for k, v in row["case"].items() if k != "graphable")), row["it"]): row["sums"]
                for row in rows if row["case"]["policy"] == policy and row["case"]["graphable"] == graphable}
    constant, epoch = calls(True), calls(False)
    assert constant and all(epoch[key] == sums for key, sums in constant.items())


def _cases(world):
    """M from 1 to a few hundred, N and K off the tile sizes, uneven K slices, with and without bias,
    residual and norm, fp16 and fp32, both layouts of b, a straggler; buffers grow and slots alternate
    across shapes. At two ranks both transports on both protocols (the same seeds, so the same inputs),
    at three and four both on the epoch protocol and the two-shot on the constant one."""
    if world == 2:
        base = [C(m=1, k=24, n=40),
                C(m=5, k=8, n=150, bias=True, dtype="float32", weight_layout=False, straggler=1, delay_s=0.2,
                  iters=1),
                C(m=9, k=24, n=100, bias=True, residual=True, norm=True, iters=1)]
        combos = [(policy, graphable) for policy in ("oneshot", "twoshot") for graphable in (False, True)]
        extra = [C(m=300, k=8, n=40, residual=True, norm=True, iters=1, policy=policy)
                 for policy in ("oneshot", "twoshot")]
    else:
        base = [C(m=2 * world + 1, k=8, n=100, bias=True, residual=True, norm=True, straggler=world - 1,
                  delay_s=0.2, iters=1)]
        combos = [("oneshot", False), ("twoshot", False), ("twoshot", True)]
        extra = [C(m=1, k=24, n=40, iters=1, policy="twoshot"),
                 C(m=130, k=8, n=40, residual=True, dtype="float32", iters=1, policy="oneshot")]
    return [dataclasses.replace(case, policy=policy, graphable=graphable)
            for policy, graphable in combos for case in base] + extra


@pytest.mark.parametrize("world", [2, 3, 4])
def test_fused_transports_against_float64(world):
    per_rank = run_ranks(world, scenarios.all_reduce_check, _cases(world))
    _check(per_rank)
    rows = per_rank[0]
    for row in rows:
        assert row["path"] == row["case"]["policy"], row
    # The graph-replayable protocol gives the epoch protocol's results bit for bit.
    for policy in ("oneshot", "twoshot") if world == 2 else ("twoshot",):
        _same_bits_on_both_protocols(rows, policy)


def test_graphable_protocol_repeated_with_stragglers():
    """The constant-valued flags, reset by their readers, called back to back as graph replays would be,
    with each rank straggling in turn: the same bits as the epoch protocol on the same inputs."""
    cases = [C(m=6, k=16, n=40, policy=policy, graphable=graphable, iters=3, straggler=straggler, delay_s=0.1,
               residual=True, norm=straggler == 1, seed=straggler)
             for graphable in (False, True) for policy, straggler in (("oneshot", 0), ("twoshot", 1))]
    per_rank = run_ranks(2, scenarios.all_reduce_check, cases)
    _check(per_rank)
    rows = per_rank[0]
    for policy in ("oneshot", "twoshot"):
        _same_bits_on_both_protocols(rows, policy)
    assert len({tuple(s) for s in _sums(rows, graphable=True)}) == 6  # fresh inputs in every call


def test_fallback_and_auto_paths():
    cases = [C(m=5, k=24, n=40, policy="fallback", bias=True),
             C(m=7, k=24, n=40, policy="fallback", residual=True, norm=True, dtype="float32"),
             C(m=3, k=8, n=16, policy="fallback", residual=True, weight_layout=False),
             C(m=3, k=8, n=16, policy="auto", dtype="bfloat16", residual=True, norm=True),
             C(m=4, k=8, n=40, policy="auto"),
             C(m=64, k=8, n=40, policy="auto", bias=True)]
    per_rank = run_ranks(2, scenarios.all_reduce_check, cases)
    _check(per_rank)
    paths = [row["path"] for row in per_rank[0] if row["it"] == 0]
    # bf16 in the interpreter: the unfused path in fp32; otherwise the rule's choice.
    expected = ["fallback"] * 4 + [choose_path(case.m, case.n, 2, 2, programs=EMULATED_SMS,
                                               slot_bytes=case.m * case.n * 2) for case in cases[4:]]
    assert paths == expected


def test_missing_peer_raises_collective_timeout():
    # Every call first agrees with the peers, so a rank that never comes is found there, within the host's
    # bound (3 s here), before any kernel waits for its data.
    kinds = [("oneshot", False), ("twoshot", False), ("oneshot", True)]
    results = run_ranks(2, scenarios.missing_peer_check, kinds, 200, env={"TILEWEAVE_EMULATED_TIMEOUT_S": "3"})
    for kind, outcome in zip(kinds, results[0]):
        assert outcome["raised"], (kind, outcome)
        assert "rank 1" in outcome["message"] and "expired" in outcome["message"], (kind, outcome)
        assert outcome["seconds"] < 20, (kind, outcome)
    assert not any(outcome["raised"] for outcome in results[1])


def test_bad_inputs_raise_named_errors_before_any_kernel():
    outcomes = run_ranks(2, scenarios.input_errors_check)[0]
    named = {"a 3-D": "a must be 2-D", "a int": "a has dtype", "b shape": "b must be [K_loc=8, N]",
             "b dtype": "b has dtype", "b device": "b is on meta", "bias shape": "bias must have shape",
             "bias dtype": "bias is torch.float32", "residual shape": "residual must have shape (4, 12)",
             "residual dtype": "residual has dtype", "residual device": "residual is on meta",
             "norm without residual": "norm_weight needs residual", "norm shape": "norm_weight must have shape (12,)",
             "eps": "eps must be", "out shape": "out must be", "policy": "policy must be one of",
             "max_spin": "max_spin", "bf16 forced fused": "bfloat16", "foreign group": "not a member"}
    for name, text in named.items():
        assert text in outcomes[name], (name, outcomes[name])
    assert outcomes["good call after"] == "oneshot (4, 12) True", outcomes


def test_path_rule_worked_examples():
    # A group of one, an empty output, and slots beyond the memory budget take no fused transport.
    assert choose_path(8, 8192, 1, 2, programs=132, slot_bytes=8 * 8192 * 2) == "local"
    assert choose_path(0, 8192, 8, 2, programs=132, slot_bytes=0) == "fallback"
    assert choose_path(4096, 8192, 8, 2, programs=132, slot_bytes=rule.FUSED_MAX_BYTES) == "fallback"
    # The module docstring's example: Llama-3-70B o_proj, N = 8192, bf16.
    assert choose_path(8, 8192, 8, 2, programs=132, slot_bytes=8 * 8192 * 2) == "oneshot"
    assert choose_path(256, 8192, 8, 2, programs=132, slot_bytes=256 * 8192 * 2) == "twoshot"
    assert choose_path(64, 8192, 2, 2, programs=132, slot_bytes=64 * 8192 * 2) == "oneshot"
    times = rule.estimates(64, 8192, 2, 2, 132)
    assert times["oneshot"] < times["twoshot"] < times["fallback"]
    # Two-shot moves (W-1)/W of the bytes twice: from W = 3 on it takes over as M grows, never at W = 2.
    for world in (4, 8):
        paths = [choose_path(m, 4096, world, 2, programs=132, slot_bytes=m * 4096 * 2) for m in (1, 512)]
        assert paths == ["oneshot", "twoshot"], (world, paths)
    assert all(choose_path(m, 4096, 2, 2, programs=132, slot_bytes=m * 4096 * 2) == "oneshot"
               for m in (1, 8, 64, 512))
    assert [rule.rows_per_program(rows, 132) for rows in (1, 132, 133, 600, 10**6)] == [2, 2, 2, 8, 16]
