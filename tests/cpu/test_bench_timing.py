"""Warm-up agreement and the verify-then-time protocol, with fake clocks, events and ranks."""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
import time

import pytest
import torch

from tileweave.bench import runner, timing
from tileweave.bench.timing import (
    LocalAgreement,
    TimingConfig,
    agree_warmup_calls,
    plan_warmup_calls,
    rotation_sets,
)


class PeerAgreement:
    """Agreement with one simulated peer: element-wise MAX with values the peer is scripted to send,
    recording what this rank contributed (the collective's sequence, as every rank must issue it)."""

    def __init__(self, peer_values: list[list[float]]) -> None:
        self.peer = list(peer_values)
        self.sent: list[list[float]] = []

    def max_floats(self, values):
        self.sent.append([float(v) for v in values])
        peer = self.peer.pop(0)
        return [max(a, b) for a, b in zip(values, peer, strict=True)]

    def max_int(self, value):
        return int(self.max_floats([float(value)])[0])


class FakeClock:
    """Each ``run`` advances time by ``per_call`` seconds."""

    def __init__(self, per_call: float) -> None:
        self.t, self.per_call, self.calls = 0.0, per_call, []

    def run(self, i: int) -> None:
        self.calls.append(i)
        self.t += self.per_call

    def now(self) -> float:
        return self.t


def test_plan_fills_the_warmup_time_within_bounds():
    cfg = TimingConfig(warmup_s=0.5)
    per_call = 0.002
    assert plan_warmup_calls(per_call, cfg=cfg) == math.ceil(cfg.warmup_s / per_call)
    assert plan_warmup_calls(1.0, cfg=cfg) == cfg.min_warmup_calls
    assert plan_warmup_calls(1e-9, cfg=cfg) == cfg.max_warmup_calls
    assert plan_warmup_calls(0.0, cfg=cfg) == cfg.max_warmup_calls


def test_ranks_agree_on_one_count_whatever_their_clocks():
    cfg = TimingConfig(warmup_s=0.5)
    fast, slow = FakeClock(0.001), FakeClock(0.004)
    fast_count = plan_warmup_calls(fast.per_call, cfg=cfg)
    slow_count = plan_warmup_calls(slow.per_call, cfg=cfg)
    assert fast_count != slow_count
    # Each rank sends its own count and receives the other's: both must end on the same number.
    got_slow = agree_warmup_calls(slow.run, cfg=cfg, agree=PeerAgreement([[fast_count]]),
                                  sync=lambda: None, clock=slow.now)
    got_fast = agree_warmup_calls(fast.run, cfg=cfg, agree=PeerAgreement([[slow_count]]),
                                  sync=lambda: None, clock=fast.now)
    assert got_slow == got_fast == max(fast_count, slow_count)
    # The probe is a fixed number of calls on every rank, independent of time.
    assert fast.calls == slow.calls == list(range(1 + cfg.probe_calls))


def test_first_call_is_not_part_of_the_estimate():
    cfg = TimingConfig(warmup_s=0.5)
    clock = FakeClock(0.002)
    compile_s = 30.0

    def run(i):
        clock.run(i)
        if i == 0:
            clock.t += compile_s  # JIT compile on the first call

    n = agree_warmup_calls(run, cfg=cfg, agree=LocalAgreement(), sync=lambda: None, clock=clock.now)
    # Counted with the compile, the estimate would be seconds per call and the floor would apply.
    assert abs(n - plan_warmup_calls(clock.per_call, cfg=cfg)) <= 1
    assert n > cfg.min_warmup_calls


class FakeEvent:
    now = 0.0

    def __init__(self, enable_timing: bool = False) -> None:
        self.t = None

    def record(self, stream=None) -> None:
        self.t = FakeEvent.now

    def elapsed_time(self, end: FakeEvent) -> float:
        return (end.t - self.t) * 1e3


def test_measure_issues_the_agreed_number_of_calls(monkeypatch):
    """No wall-time-bounded loop: calls = 1 + probe + agreed warm-up + reps * iters + one batch of iters
    for the host's time, on every rank."""
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    cfg = TimingConfig(warmup_s=0.5, iters=20, reps=5)
    per_call_ms = [1.0, 1.0, 3.0, 1.0, 1.0]  # one slow rep: the median ignores it
    calls = []

    def call(i):
        calls.append(i)
        rep = max(0, (len(calls) - 1 - (1 + cfg.probe_calls + agreed)) // cfg.iters)
        FakeEvent.now += per_call_ms[min(rep, cfg.reps - 1)] * 1e-3

    class Clocks:
        def read(self, device):
            return 1480.0

    # This rank's probe sees 1 ms per call, so it asks for warmup_s / 1 ms calls; the peer asks for more.
    agreed = plan_warmup_calls(1e-3, cfg=cfg) + 77
    fences = []
    agree = PeerAgreement([[agreed], [0.0, -1500.0, 0.5]])
    result = timing.measure(call, cfg=cfg, agree=agree, clocks=Clocks(), fence=lambda: fences.append(len(calls)),
                            clock=lambda: FakeEvent.now)
    assert len(calls) == 1 + cfg.probe_calls + agreed + (cfg.reps + 1) * cfg.iters
    assert calls == list(range(len(calls)))  # every call gets a fresh rotation index
    assert result.warmup_calls == agreed
    assert result.ms == pytest.approx(1.0)
    assert result.rep_ms[2] == pytest.approx(3.0)
    assert result.clock_mhz == 1480.0  # the lower of the two ranks' clocks
    # Here the host's clock is the GPU's: issuing took as long as running (host-bound), in the batch
    # after the timed ones.
    assert result.host_ms == pytest.approx(1.0)
    # Fences sit around the timed batches and the host batch, never inside.
    assert fences == [1 + cfg.probe_calls + agreed, len(calls)]


def test_clock_sampler_reports_the_median_of_readings_taken_during_the_work():
    values = [random.uniform(1100.0, 1980.0) for _ in range(2000)]
    taken = []

    class Reader:
        def read(self, device):
            taken.append(device)
            return values[len(taken) - 1]

    with timing.ClockSampler(Reader(), 3, period_s=0.001) as sampler:
        while len(taken) < 6:
            time.sleep(0.001)
    count = len(taken)
    time.sleep(0.01)
    assert len(taken) == count  # the thread stopped with the block
    assert set(taken) == {3}
    assert sampler.median() == statistics.median(values[:count])

    class Unreadable:
        def read(self, device):
            return None

    with timing.ClockSampler(Unreadable(), 0) as sampler:
        pass
    assert sampler.median() is None

    class Slow:  # a reading that takes 5 ms: the next one waits ~100 ms, not the 1 ms period
        def __init__(self):
            self.count = 0

        def read(self, device):
            self.count += 1
            time.sleep(0.005)
            return 1500.0

    slow = Slow()
    with timing.ClockSampler(slow, 0, period_s=0.001):
        time.sleep(0.15)
    assert 1 <= slow.count <= 3


def test_rotation_spans_twice_l2():
    l2 = timing.L2_BYTES
    assert rotation_sets(l2) == 1
    assert rotation_sets(l2 // 4) == 8
    assert rotation_sets(l2 // 3 + 1) * (l2 // 3 + 1) >= 2 * l2
    assert rotation_sets(1) == timing.MAX_ROTATION_SETS
    with pytest.raises(ValueError):
        rotation_sets(0)


@pytest.mark.parametrize("field, value", [("iters", 19), ("reps", 4), ("warmup_s", -1.0), ("probe_calls", 0)])
def test_timing_config_enforces_the_design_minimums(field, value):
    with pytest.raises(ValueError, match=field):
        TimingConfig(**{field: value})


# run_variant: the decisions that change which collectives a rank issues are agreed first.

class NoMemory:
    def rearm(self):
        pass

    def read(self):
        return (0, 0)


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(runner, "MemoryWatch", NoMemory)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    timed = []

    def fake_measure(call, **kw):
        timed.append(call)
        return timing.Timing(ms=1.0, rep_ms=(1.0,) * 5, warmup_calls=9, clock_mhz=None)

    monkeypatch.setattr(runner, "measure", fake_measure)
    return timed


def ctx_with(agree) -> runner.RankContext:
    return runner.RankContext(rank=1, world_size=2, group=None, agree=agree, clocks=timing.ClockReader(),
                              timing=TimingConfig())


KEY = dict(op="ag", layer="llama3-8b qkv", world_size=2, m=1024, k=4096, n=6144)


def variant(err: float):
    from tileweave.bench.variants import Variant

    return Variant(name="ours", call=lambda i: i, check=lambda out: err, path=lambda: "fused")


def test_variant_verified_everywhere_is_timed(no_gpu):
    agree = PeerAgreement([[0.0], [0.0, 0.001], [0.0, 0.0], [0.0, 0.002]])
    m = runner.run_variant(ctx_with(agree), variant(0.003), key=KEY)
    assert m.status == "ok" and m.rel_err == pytest.approx(0.003) and m.path == "fused"
    assert len(no_gpu) == 1
    assert agree.sent[:2] == [[0.0], [0.0, 0.003]] and agree.sent[3] == [0.0, 0.003]


def test_reported_path_is_the_timed_calls_path(no_gpu, monkeypatch):
    # A call may change path once its shape has been seen (replay runs a shape's first call eagerly,
    # then from a graph): the report names the path of the calls it timed, not the first call's.
    from tileweave.bench.variants import Variant

    taken = []

    def call(i):
        taken.append("chunked" if not taken else "replay")
        return i

    def timing_calls(call, **kw):
        for i in range(3):
            call(i)
        return timing.Timing(ms=1.0, rep_ms=(1.0,) * 5, warmup_calls=3, clock_mhz=None)

    monkeypatch.setattr(runner, "measure", timing_calls)
    v = Variant(name="ours", call=call, check=lambda out: 0.0, path=lambda: taken[-1])
    m = runner.run_variant(ctx_with(PeerAgreement([[0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]])), v, key=KEY)
    # the first call verified, three timed, one more verified after them
    assert taken == ["chunked", "replay", "replay", "replay", "replay"] and m.path == "replay"


def test_the_route_the_timed_calls_took_is_verified(no_gpu, monkeypatch):
    # A variant right on its first call and wrong on every repeat (a cached plan or graph that
    # computes something else): verifying the first call alone would report its time as valid.
    from tileweave.bench.variants import Variant, rel_err

    ref = torch.arange(12.0).reshape(3, 4)
    calls = []

    def call(i):
        calls.append(i)
        return ref.clone() if len(calls) == 1 else ref.flip(0)

    def timing_calls(call, **kw):
        for i in range(1, 4):
            call(i)
        return timing.Timing(ms=1.0, rep_ms=(1.0,) * 5, warmup_calls=3, clock_mhz=None)

    monkeypatch.setattr(runner, "measure", timing_calls)
    v = Variant(name="ours", call=call, check=lambda out: rel_err(out, ref), path=lambda: "fused")
    agree = PeerAgreement([[0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    m = runner.run_variant(ctx_with(agree), v, key=KEY)
    assert calls == [0, 1, 2, 3, 0]
    assert m.status == "FAILED" and m.ms is None, m
    assert "after timing" in m.note and "rel_err" in m.note and m.rel_err > 0.5, m
    assert agree.sent[3][0] == 1.0  # the failure was announced to the peers

    # A peer's repeat route failing fails the row here too.
    calls.clear()
    v = Variant(name="ours", call=call, check=lambda out: 0.0, path=lambda: "fused")
    m = runner.run_variant(ctx_with(PeerAgreement([[0.0], [0.0, 0.0], [0.0, 0.0], [1.0, 0.3]])), v, key=KEY)
    assert m.status == "FAILED" and "another rank" in m.note, m


def test_failure_on_a_peer_skips_timing_here_too(no_gpu):
    agree = PeerAgreement([[0.0], [1.0, 0.5]])
    m = runner.run_variant(ctx_with(agree), variant(0.003), key=KEY)
    assert m.status == "FAILED" and "another rank" in m.note and m.rel_err == pytest.approx(0.5)
    assert no_gpu == []


def test_local_failure_and_exceptions_are_recorded_not_raised(no_gpu):
    m = runner.run_variant(ctx_with(PeerAgreement([[0.0], [0.0, 0.0]])), variant(0.05), key=KEY)
    assert m.status == "FAILED" and "rel_err" in m.note
    nan = runner.run_variant(ctx_with(PeerAgreement([[0.0], [0.0, 0.0]])), variant(math.nan), key=KEY)
    assert nan.status == "FAILED" and nan.rel_err is None

    def boom(i):
        raise RuntimeError("bad launch")

    v = dataclasses.replace(variant(0.0), call=boom)
    agree = PeerAgreement([[0.0], [0.0, 0.0]])
    m = runner.run_variant(ctx_with(agree), v, key=KEY)
    assert m.status == "FAILED" and "bad launch" in m.note
    assert agree.sent[1][0] == 1.0  # the failure was announced to the peers
    assert no_gpu == []


def test_missing_anywhere_is_na_everywhere(no_gpu):
    from tileweave.bench.variants import Variant

    m = runner.run_variant(ctx_with(PeerAgreement([[0.0]])), Variant(name="ours", call=None, note="no op"), key=KEY)
    assert m.status == "n/a" and m.note == "no op"
    m = runner.run_variant(ctx_with(PeerAgreement([[1.0]])), variant(0.0), key=KEY)
    assert m.status == "n/a"
    assert no_gpu == []
