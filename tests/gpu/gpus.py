"""What the GPU test modules share: the ranks of their distributed tests and the marks that skip a test
where the GPUs it needs are missing. A test module imports it before anything of tileweave: under the
Triton interpreter (switched on by tests/cpu for its whole process) the import skips the module.

pytest finds it because tests/gpu, a folder without ``__init__.py``, is on ``sys.path`` for its tests.
"""

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") == "1":  # set by tests/cpu in the same process: run us apart
    pytest.skip("GPU tests need Triton compiled, not interpreted: run tests/gpu in its own pytest",
                allow_module_level=True)

from tileweave.testing.emulated import gpu_ranks  # noqa: E402

RANKS = gpu_ranks() if torch.cuda.is_available() else 0
"""Ranks of the distributed tests: one per GPU, or TILEWEAVE_GPU_RANKS (more than the GPUs: they share them)."""
SHARED = RANKS > torch.cuda.device_count()
"""Whether the ranks share GPUs (``tileweave.testing.shared_gpu``)."""

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_two = pytest.mark.skipif(RANKS < 2, reason="needs two CUDA GPUs (or TILEWEAVE_GPU_RANKS=2 on one)")


def one_gpu_per_rank(needed_by: str) -> pytest.MarkDecorator:
    """A mark that skips a test where the ranks share GPUs; ``needed_by``: what the test runs that cannot
    run so (it ends the skip reason)."""
    return pytest.mark.skipif(SHARED, reason=f"needs one GPU per rank ({needed_by})")
