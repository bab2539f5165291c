"""The first launch of a fused signature on GPUs: every rank compiles without launching, meets the
others, then launches; later calls launch at once. Checked with the launcher and the barrier recorded
(the compile goes through ``launch(compile_only=True)``, launches through ``launch_cached``)."""

import types

from tileweave.ops import _fused


def _record(monkeypatch):
    calls = []
    monkeypatch.setattr(_fused._launch, "launch", lambda **kw: calls.append(("launch", kw.get("compile_only", False))))
    monkeypatch.setattr(_fused._launch, "launch_cached", lambda **kw: calls.append(("launch", False)))
    monkeypatch.setattr(_fused.dist, "barrier", lambda **kw: calls.append(("barrier", kw["device_ids"])))
    return calls


def test_first_call_compiles_then_meets_then_launches(monkeypatch):
    calls = _record(monkeypatch)
    gpu = types.SimpleNamespace(interpreter=False, group="tp", device=types.SimpleNamespace(index=3))
    _fused.FusedOp._launch_kernel(gpu, True, mode=1)
    assert calls == [("launch", True), ("barrier", [3]), ("launch", False)]
    calls.clear()
    _fused.FusedOp._launch_kernel(gpu, False, mode=1)
    assert calls == [("launch", False)]


def test_a_failed_compile_still_meets_and_lets_the_launch_report(monkeypatch):
    calls = []

    def launch(**kw):
        calls.append(("launch", kw.get("compile_only", False)))
        if kw.get("compile_only"):
            raise RuntimeError("compile failed")

    monkeypatch.setattr(_fused._launch, "launch", launch)
    monkeypatch.setattr(_fused._launch, "launch_cached", launch)
    monkeypatch.setattr(_fused.dist, "barrier", lambda **kw: calls.append(("barrier", kw["device_ids"])))
    gpu = types.SimpleNamespace(interpreter=False, group="tp", device=types.SimpleNamespace(index=0))
    _fused.FusedOp._launch_kernel(gpu, True, mode=2)
    assert calls == [("launch", True), ("barrier", [0]), ("launch", False)]


def test_the_interpreter_launches_without_meeting(monkeypatch):
    calls = _record(monkeypatch)
    cpu = types.SimpleNamespace(interpreter=True, group="tp", device=types.SimpleNamespace(index=None))
    _fused.FusedOp._launch_kernel(cpu, True, mode=1)
    assert calls == [("launch", False)]
