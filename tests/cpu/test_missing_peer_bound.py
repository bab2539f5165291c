"""The default in-kernel spin bound reports a missing peer within about the host's timeout."""

from __future__ import annotations

import time

import pytest

from tileweave.runtime import emulated
from support import scenarios
from tileweave.testing.emulated import run_ranks


def test_the_default_bound_follows_the_host_timeout():
    assert emulated.default_max_spin(60) == 25_000
    assert emulated.default_max_spin(6) == 2_500
    # polls x time per poll x waits that expire in turn = the host's timeout
    assert emulated.default_max_spin(60) * emulated.INTERPRETER_POLL_S * emulated.EXPIRIES_PER_CALL == pytest.approx(60)


def test_a_missing_peer_is_reported_within_about_the_host_timeout():
    # The fused all-gather GEMM: its waits on the missing peer expire one after another (the longest
    # case). A short host timeout (6 s) keeps the test short; the default bound scales with it. The old
    # default (200 000 polls, ~4 minutes in the interpreter) would run into run_ranks' timeout.
    host_timeout_s = 6
    start = time.monotonic()
    outcomes = run_ranks(2, scenarios.missing_peer_check, None, "ag", timeout_s=120,
                         env={"TILEWEAVE_EMULATED_TIMEOUT_S": str(host_timeout_s)})
    elapsed = time.monotonic() - start
    assert outcomes[0]["raised"] and "rank 1" in outcomes[0]["message"], outcomes[0]
    # Rank start and the first (agreed) call take up to half a minute on a loaded machine; the old
    # bound would have taken over 200 s.
    assert elapsed < 60, f"the missing peer was reported after {elapsed:.0f} s"
