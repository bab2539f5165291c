"""``run_ranks`` reports a rank that dies at once, and leaves no heap file or rank behind when its
caller is interrupted or killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support import rank_faults
from tileweave.testing import emulated
from tileweave.testing.emulated import RankFailed, run_ranks

SRC = str(Path(__file__).resolve().parents[2] / "src")
TESTS = str(Path(__file__).resolve().parents[1])


@pytest.mark.parametrize(("how", "reason"), [("exit3", "exited with code 3"), ("sigkill", "was killed by SIGKILL")])
def test_a_dead_rank_is_reported_at_once(how, reason):
    start = time.monotonic()
    with pytest.raises(RankFailed) as caught:
        run_ranks(2, rank_faults.die_on_rank, 1, how, timeout_s=120)
    elapsed = time.monotonic() - start
    assert f"rank 1 {reason}" in str(caught.value), str(caught.value)
    assert elapsed < 30, f"the dead rank was reported after {elapsed:.0f} s (the timeout is 120 s)"


def _heaps_of(pid: int) -> list[str]:
    """The heap files of the run in process ``pid`` (its rendezvous files: ``_rendezvous_of``)."""
    return sorted(name for name in os.listdir(emulated._heap_dir())
                  if name.startswith(f"tileweave-heap-{pid}-") and not name.endswith(emulated.RENDEZVOUS_SUFFIX))


def _rendezvous_of(pid: int) -> list[str]:
    return sorted(name for name in os.listdir(emulated._heap_dir())
                  if name.startswith(f"tileweave-heap-{pid}-") and name.endswith(emulated.RENDEZVOUS_SUFFIX))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by the fork server) counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _start_hanging_run(directory: Path) -> subprocess.Popen:
    directory.mkdir()
    script = ("import sys\n"
              "from support import rank_faults\n"
              "from tileweave.testing import emulated\n"
              "if __name__ == '__main__':\n"
              "    emulated.run_ranks(2, rank_faults.record_pid_and_hang, sys.argv[1], timeout_s=600)\n")
    (directory / "hang.py").write_text(script)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, TESTS, os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, str(directory / "hang.py"), str(directory)], env=env)


def _rank_pids(directory: Path, proc: subprocess.Popen) -> list[int]:
    deadline = time.monotonic() + 90
    while not all((directory / f"rank{r}.pid").exists() for r in range(2)):
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            pytest.fail("the ranks of the hanging run did not start")
        time.sleep(0.1)
    return [int((directory / f"rank{r}.pid").read_text()) for r in range(2)]


def test_a_killed_run_leaves_no_heap_file_or_rank_behind(tmp_path):
    # Two runs at once (their start is most of the time): one ended by SIGTERM, one killed outright.
    signals = (signal.SIGTERM, signal.SIGKILL)
    procs = {sig: _start_hanging_run(tmp_path / sig.name) for sig in signals}
    ranks: list[int] = []
    try:
        for sig, proc in procs.items():
            ranks += _rank_pids(tmp_path / sig.name, proc)
            assert len(_heaps_of(proc.pid)) == 1, "a run's heap file is named after its process"
            assert len(_rendezvous_of(proc.pid)) == 1, "a run's rendezvous file is named after its heap"
        for sig, proc in procs.items():
            proc.send_signal(sig)
            proc.wait(timeout=30)
        assert _heaps_of(procs[signal.SIGTERM].pid) == [], "a run ended by SIGTERM left its heap file behind"
        assert _rendezvous_of(procs[signal.SIGTERM].pid) == [], "a run ended by SIGTERM left its rendezvous file"
        # Nothing runs in a process killed outright: its file is stale, and the next run removes it.
        killed = procs[signal.SIGKILL].pid
        stale = _heaps_of(killed)
        assert len(stale) == 1
        stale_rendezvous = _rendezvous_of(killed)
        assert len(stale_rendezvous) == 1
        removed = [os.path.basename(path) for path in emulated.remove_stale_heaps()]
        assert stale[0] in removed and _heaps_of(killed) == []
        assert stale_rendezvous[0] in removed and _rendezvous_of(killed) == [], "a killed run's rendezvous file stayed"
        deadline = time.monotonic() + 15
        while any(map(_alive, ranks)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(map(_alive, ranks)), "ranks outlived the run that started them"
    finally:
        for proc in procs.values():
            proc.kill()
        for pid in ranks:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_stale_heaps_of_live_or_foreign_owners_stay(tmp_path):
    live = tmp_path / f"tileweave-heap-{os.getpid()}-abc"
    foreign = tmp_path / "tileweave-heap-xyz"  # no owner in the name: left alone
    dead_pid = _a_dead_pid()
    stale = tmp_path / f"tileweave-heap-{dead_pid}-abc"
    for path in (live, foreign, stale):
        path.write_bytes(b"")
    assert emulated.remove_stale_heaps(str(tmp_path)) == [str(stale)]
    assert live.exists() and foreign.exists() and not stale.exists()


def _a_dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _return_or_raise_at_once(rank, world, raising):
    if rank == raising:
        raise ValueError(f"rank {rank} refuses")
    return rank


def test_ranks_that_finish_at_once_do_not_fail_their_peers_start():
    # A rank function that returns (or raises) before any collective: every run reports the functions'
    # own outcome, never a peer's failed start-up.
    for attempt in range(5):  # each rank the refusing one at least once
        assert run_ranks(2, _return_or_raise_at_once, -1) == [0, 1]
        with pytest.raises(RankFailed) as info:
            run_ranks(3, _return_or_raise_at_once, attempt % 3)
        assert f"rank {attempt % 3} refuses" in str(info.value)
        assert "connectFullMesh" not in str(info.value)


def test_ranks_return_tensors_by_value():
    results = run_ranks(2, rank_faults.return_tensors, 5)
    for rank, (t, d) in enumerate(results):
        assert t.tolist() == [float(i * (rank + 1)) for i in range(5)]
        assert d["rank"] == rank and float(d["sum"]) == 10.0 * (rank + 1) and d["view"].tolist() == t.tolist()[1:]


def test_every_rank_that_raised_is_named_with_its_error():
    with pytest.raises(RankFailed) as caught:
        run_ranks(3, rank_faults.raise_on_every_rank)
    message = str(caught.value)
    for rank in range(3):
        assert f"ValueError: bad input on rank {rank}" in message, message
    assert "before returning a result" not in message, message


def test_no_agreement_segment_outlives_its_ranks():
    # Rank 0 makes the group's agreement segment at its first op; rank 1 raises before mapping it.
    from tileweave.runtime import agreement, files

    def leftovers() -> set[str]:
        # Segments not held by a running process (a concurrent run's are; a name without its maker's pid
        # has no owner to wait for).
        prefix = agreement.SEGMENT_PREFIX
        owner = lambda name: name[len(prefix):].split("-")[0]  # noqa: E731
        return {name for name in os.listdir(files.shm_dir()) if name.startswith(prefix)
                and not (owner(name).isdigit() and files.process_alive(int(owner(name))))}

    before = leftovers()
    with pytest.raises(RankFailed, match="rank 1 raises before its first op"):
        run_ranks(2, rank_faults.raise_before_the_first_op, env={"TILEWEAVE_EMULATED_TIMEOUT_S": "5"})
    assert leftovers() - before == set()


def test_a_script_without_the_main_guard_is_told_so(tmp_path):
    body = "from tileweave.testing.emulated import run_ranks\n\ndef f(rank, world):\n    return rank\n\n"
    (tmp_path / "bare.py").write_text(body + "print(run_ranks(2, f))\n")
    (tmp_path / "guarded.py").write_text(body + "if __name__ == '__main__':\n    print(run_ranks(2, f))\n")
    env = {**os.environ, "PYTHONPATH": SRC}
    bare = subprocess.run([sys.executable, "bare.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert bare.returncode != 0
    assert "without 'if __name__ == \"__main__\":'" in bare.stderr.splitlines()[-1], bare.stderr[-2000:]
    guarded = subprocess.run([sys.executable, "guarded.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=300)
    assert guarded.returncode == 0 and guarded.stdout.strip() == "[0, 1]", guarded.stderr[-2000:]
