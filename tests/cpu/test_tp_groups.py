"""Several TP groups in one world on emulated ranks: groups that compute at once on different data each
get their own result (their symmetric buffers never overlap), and so does a process in two groups."""

from support import scenarios
from tileweave.testing.emulated import run_ranks


def test_two_tp_groups_compute_at_once():
    for rank, result in enumerate(run_ranks(4, scenarios.two_groups_check, 5, 24, 8, 2)):
        for part, errors in result.items():
            for op, err in errors.items():
                assert err < 1e-5, (rank, part, op, result)


def test_a_group_across_hosts_runs_on_nccl_with_one_warning():
    results = run_ranks(4, scenarios.across_hosts_check, 5, 24, 8, env={"TILEWEAVE_EMULATED_HOSTS": "2"})
    for rank, result in enumerate(results):
        assert result["pair_paths"] == "fused chunked", result
        assert result["world_paths"] == "fallback fallback", result
        assert result["all_reduce_path"] == "fallback", result
        for part in ("pair", "world", "all_reduce"):
            for op, err in result[part].items():
                assert err < 1e-5, (rank, part, op, result)
        if rank == 0:
            assert len(result["warnings"]) == 1, result["warnings"]
            assert "spans 2 hosts" in result["warnings"][0] and "NCCL path" in result["warnings"][0], result
        else:
            assert result["warnings"] == [], result
