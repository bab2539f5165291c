"""Several TP groups in one world on emulated ranks: groups that compute at once on different data each
get their own result (their symmetric buffers never overlap), and so does a process in two groups."""

from support import scenarios
from tileweave.testing.emulated import run_ranks


def test_two_tp_groups_compute_at_once():
    for rank, result in enumerate(run_ranks(4, scenarios.two_groups_check, 5, 24, 8, 2)):
        for part, errors in result.items():
            for op, err in errors.items():
                assert err < 1e-5, (rank, part, op, result)
