"""The host's bound on a wait for a peer (``TILEWEAVE_TIMEOUT_S``, a minute by default) does not count a
peer's first compile of a call's kernels: a rank in a signature's first call, after its agreement, is
marked on its groups' agreement segments (``runtime.agreement.first_call``), and a wait for it starts
again once the mark is gone. A rank that compiles for longer than the bound (emulated:
``support.slow_compile``) makes no peer raise; a rank that is dead, or has been in a first call for
longer than the allowance, counts against the bound as any late rank does."""

from __future__ import annotations

import subprocess
import sys



from support import slow_compile
from tileweave.runtime import agreement, settings
from tileweave.testing.emulated import run_ranks

HOST_BOUND_S = 2.0
COMPILE_S = 3.0


def test_a_slow_first_compile_is_not_counted_in_a_peers_bounded_wait():
    results = run_ranks(2, slow_compile.first_calls_check, COMPILE_S,
                        env={"TILEWEAVE_EMULATED_TIMEOUT_S": str(HOST_BOUND_S)})
    for rank, result in enumerate(results):
        assert "raised" not in result, (rank, result)
        assert result["moe_plan"] == 0.0, (rank, result)
        for op in ("all_gather_gemm", "gemm_reduce_scatter", "moe_all_gather_gemm"):
            assert result[op] < 1e-5, (rank, op, result)


def _segment(world: int = 2, rank: int = 0) -> agreement._Segment:
    size = 2 * world * agreement.SLOT_BYTES + world * (agreement._PID.size + agreement._SINCE.size)
    return agreement._Segment(bytearray(size), rank, world)


def test_a_rank_is_in_a_first_call_while_marked_and_alive():
    mine = _segment(rank=0)
    assert not mine.in_first_call(0)
    mine.mark_first_call(True)
    assert mine.in_first_call(0)
    theirs = agreement._Segment(mine.memory, 1, 2)  # rank 1 reads rank 0's mark
    assert theirs.in_first_call(0) and not theirs.in_first_call(1)
    mine.mark_first_call(False)
    assert not theirs.in_first_call(0)


def test_a_dead_rank_or_one_past_the_allowance_is_not_in_a_first_call(monkeypatch):
    segment = _segment()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    segment.mark_first_call(True)
    agreement._PID.pack_into(segment.memory, segment.first_call_offset(0), dead.pid)
    assert not segment.in_first_call(0)
    segment.mark_first_call(True)
    assert segment.in_first_call(0)
    monkeypatch.setattr(agreement, "FIRST_CALL_ALLOWANCE_S", 0.0)
    assert not segment.in_first_call(0)


def test_the_host_bound_defaults_to_a_minute(monkeypatch):
    monkeypatch.delenv(settings.TIMEOUT_S, raising=False)
    monkeypatch.delenv(settings.EMULATED_TIMEOUT_S, raising=False)
    assert settings.timeout_s() == settings.emulated_timeout_s() == 60.0
    # The table of settings' docstring says so too.
    rows = {line.split()[0]: line.split()[1] for line in settings.__doc__.splitlines() if line.startswith("``TILE")}
    assert rows["``TILEWEAVE_TIMEOUT_S``"] == rows["``TILEWEAVE_EMULATED_TIMEOUT_S``"] == "60"
    monkeypatch.setenv(settings.TIMEOUT_S, "75")
    assert settings.timeout_s() == 75.0


def test_a_first_call_marks_every_group_of_the_process_and_nested_blocks_keep_the_mark(monkeypatch):
    tp, dp = _segment(rank=1), _segment(world=4, rank=3)
    monkeypatch.setattr(agreement, "_segments", {("tp",): tp, ("dp",): dp})
    with agreement.first_call():
        with agreement.first_call():
            assert tp.in_first_call(1) and dp.in_first_call(3)
        assert tp.in_first_call(1) and dp.in_first_call(3)
    assert not tp.in_first_call(1) and not dp.in_first_call(3)
