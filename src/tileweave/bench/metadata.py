"""What a benchmark run records of where and with what its numbers were taken: versions, GPU, commit,
the environment variables that change paths, the command line."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

COMMIT_ENV = "TILEWEAVE_GIT_COMMIT"
"""Commit to record instead of asking git: a tree copied to a GPU machine may carry no git metadata,
or stale metadata that names an older commit."""
RECORDED_ENV = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS", "TILEWEAVE_POLICY",
                "TILEWEAVE_RS_TRANSPORT", "TILEWEAVE_AG_TRANSPORT", "TILEWEAVE_MAX_SPIN", "TILEWEAVE_RS_PULL",
                "TILEWEAVE_AG_STREAM_K", "TILEWEAVE_GRAPHABLE")
"""Environment variables whose values a report records."""


def _run(cmd: Sequence[str], cwd: Path) -> str | None:
    try:
        return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=10, check=True).stdout
    except Exception:
        return None


def collect_metadata(*, world_size: int, timing: dict[str, Any], argv: Sequence[str]) -> dict[str, Any]:
    """Where and with what the numbers were taken. Works without CUDA (GPU fields become "n/a")."""
    import numpy
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except Exception:
        triton_version = "n/a"
    here = Path(__file__).resolve().parent
    # safe.directory: a checkout copied to the GPU machine is often owned by another user.
    git = ["git", "-c", f"safe.directory={here.parents[2]}"]
    # A copy of the tree shipped to a GPU machine is told its commit; it may have no .git or an old one.
    commit = os.environ.get(COMMIT_ENV)
    source = "env" if commit else None
    dirty = None
    if not commit:
        commit = _run([*git, "rev-parse", "HEAD"], here)
        dirty = _run([*git, "status", "--porcelain"], here) if commit else None
        source = "git" if commit else None
    cuda = torch.cuda.is_available()
    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "hostname": socket.gethostname(),
        "gpu_name": torch.cuda.get_device_name(0) if cuda else "n/a",
        "gpu_count": torch.cuda.device_count() if cuda else 0,
        "world_size": world_size,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton_version,
        "numpy": numpy.__version__,
        "cuda": torch.version.cuda or "n/a",
        "git_commit": commit.strip() if commit else "n/a",
        "git_commit_source": source,
        "git_dirty": bool(dirty.strip()) if dirty is not None else None,
        "timing": dict(timing),
        "env": {k: os.environ.get(k) for k in RECORDED_ENV},
        "argv": list(argv),
        "executable": sys.executable,
    }
