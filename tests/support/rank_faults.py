"""Rank functions for testing ``run_ranks`` itself: ranks that die, hang or report their process."""

from __future__ import annotations

import os
import signal
import time


def die_on_rank(rank: int, world: int, victim: int, how: str) -> int:
    """Rank ``victim`` ends without a result (``how``: "exit3", ``os._exit(3)``; "sigkill": killed by
    SIGKILL) while the others wait for it in a way no collective notices (a flag wait, here a sleep)."""
    if rank == victim:
        if how == "exit3":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(600)
    return rank


def record_pid_and_hang(rank: int, world: int, directory: str) -> None:
    """Write this rank's pid to ``directory/rank<r>.pid``, then sleep (a run that gets killed)."""
    path = os.path.join(directory, f"rank{rank}.pid")
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)
    time.sleep(600)


def return_tensors(rank: int, world: int, n: int):
    """A tensor and a dict holding one, made in the rank (the parent must get them by value)."""
    import torch

    t = torch.arange(n, dtype=torch.float32) * (rank + 1)
    return t, {"rank": rank, "sum": t.sum(), "view": t[1:]}


def raise_on_every_rank(rank: int, world: int) -> None:
    raise ValueError(f"bad input on rank {rank}")


def raise_before_the_first_op(rank: int, world: int) -> None:
    """Rank 1 raises at once; the others call an op, whose agreement sets up the group's segment and
    then waits (bounded) for rank 1."""
    import torch

    import tileweave

    if rank == 1:
        raise ValueError("rank 1 raises before its first op")
    a = torch.randn(4, 8, dtype=torch.float16)
    b = torch.randn(8, 4, dtype=torch.float16)
    tileweave.gemm_all_reduce(a, b)
