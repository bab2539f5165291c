"""The first launch of a fused signature on GPUs: every rank compiles without launching, meets the
others, then launches; later calls launch at once. Checked with the launcher and the barrier recorded
(the compile goes through ``launch(compile_only=True)``, launches through ``launch_cached``). The
one-shot kernels' plans do the same before their first launch (``OneshotPlan.meet``)."""

import contextlib
import types

import pytest
import torch

from tileweave.ops import dense, skeleton
from tileweave.ops.all_gather import push
from tileweave.ops.compute import oneshot_launch
from tileweave.runtime import triton_launch


def _record(monkeypatch):
    calls = []
    monkeypatch.setattr(push, "launch", lambda **kw: calls.append(("launch", kw.get("compile_only", False))))
    monkeypatch.setattr(push, "launch_cached", lambda **kw: calls.append(("launch", False)))
    monkeypatch.setattr(skeleton.dist, "barrier", lambda **kw: calls.append(("barrier", kw["device_ids"])))
    return calls


def _launch_twice(backend) -> None:
    """A plan's first launch, then its second."""
    plan = dense.Plan("fused", None, backend)
    call = skeleton.Call("all_gather_gemm", backend, plan, None, None, False, 1)
    push.launch_fused(call, a=None)
    push.launch_fused(call, a=None)


def test_first_call_compiles_then_meets_then_launches(monkeypatch):
    calls = _record(monkeypatch)
    _launch_twice(types.SimpleNamespace(interpreter=False, group="tp", device=torch.device("cuda", 3)))
    assert calls == [("launch", True), ("barrier", [3]), ("launch", False), ("launch", False)]


def test_a_failed_compile_still_meets_and_lets_the_launch_report(monkeypatch):
    calls = []

    def launch(**kw):
        calls.append(("launch", kw.get("compile_only", False)))
        if kw.get("compile_only"):
            raise RuntimeError("compile failed")

    monkeypatch.setattr(push, "launch", launch)
    monkeypatch.setattr(push, "launch_cached", launch)
    monkeypatch.setattr(skeleton.dist, "barrier", lambda **kw: calls.append(("barrier", kw["device_ids"])))
    _launch_twice(types.SimpleNamespace(interpreter=False, group="tp", device=torch.device("cuda", 0)))
    assert calls == [("launch", True), ("barrier", [0]), ("launch", False), ("launch", False)]


def test_the_interpreter_launches_without_meeting(monkeypatch):
    calls = _record(monkeypatch)
    _launch_twice(types.SimpleNamespace(interpreter=True, group="tp", device=torch.device("cpu")))
    assert calls == [("launch", False), ("launch", False)]


def _oneshot_plan(calls):
    return oneshot_launch.OneshotPlan(peer_offsets=None, signals=None, ready=None, err=None, host_err=None, rank=0, world=2,
                               rows=64, cols=256, max_spin=1, programs=4, meet=lambda: calls.append("meet"))


class _Kernel:
    """A kernel function that records its compiles and launches."""

    def __init__(self, calls, compiles=True):
        self.calls, self.compiles = calls, compiles

    def warmup(self, *args, grid, **kwargs):
        self.calls.append("compile")
        if not self.compiles:
            raise RuntimeError("compile failed")
        return None

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append("launch")


@pytest.mark.parametrize("compiles", [True, False])
def test_a_oneshot_plan_compiles_then_meets_once_before_its_first_launch(monkeypatch, compiles):
    # On a GPU (faked: the device context does nothing, launches go through the kernel function): even
    # a failed compile meets, since the peers wait there; later launches neither compile nor meet.
    monkeypatch.setattr(oneshot_launch.torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(triton_launch, "FAST", False)
    calls = []
    plan = _oneshot_plan(calls)
    tensor = types.SimpleNamespace(device=torch.device("cuda", 0))
    for _ in range(3):
        plan.launch(_Kernel(calls, compiles), ("key",), (tensor,), (1,), {})
    assert calls == ["compile", "meet", "launch", "launch", "launch"]


def test_a_oneshot_plan_in_the_interpreter_meets_without_compiling():
    calls = []
    plan = _oneshot_plan(calls)
    for _ in range(2):
        plan.launch(_Kernel(calls), ("key",), (torch.zeros(1),), (1,), {})
    assert calls == ["meet", "launch", "launch"]

