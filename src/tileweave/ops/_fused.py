"""What the two fused ops share: their settings, their group's backend, and the per-shape decision of
path and kernel config that every rank must agree on before anything is allocated or launched."""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

import torch
import torch.distributed as dist

from tileweave.ops.workspace import Workspace, agree
from tileweave.runtime.backend import Backend, get_backend
from tileweave.tune.autotune import select_config
from tileweave.tune.configs import GemmConfig

POLICIES = ("auto", "fused", "fallback")


class FusedOp:
    """Base of ``AllGatherGemm`` and ``GemmReduceScatter``: one group, one workspace, reused."""

    op_name = ""

    def __init__(self, group: dist.ProcessGroup | None, *, policy: str, config: GemmConfig | None,
                 max_spin: int | None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.group = group if group is not None else dist.group.WORLD
        # TILEWEAVE_POLICY overrides "auto" process-wide (the benchmark uses it to time one path).
        self.policy = os.environ.get("TILEWEAVE_POLICY", "auto") if policy == "auto" else policy
        self.config = config
        self.max_spin = max_spin
        self._ws: Workspace | None = None
        self._agreed: dict[tuple, object] = {}
        self._backend: Backend | None = None

    def _get_backend(self, device: torch.device) -> Backend:
        if self._backend is None or self._backend.device != device:
            self._backend = get_backend(self.group, device)
        return self._backend

    def _decide(self, backend: Backend, m: int, n: int, k: int, dtype: torch.dtype, device: torch.device,
                prefer_fused: Callable[..., bool], shape: tuple, has_bias: bool,
                **config_overrides) -> tuple[bool, GemmConfig]:
        """Fused or not, and with which config: rank 0's choice, checked against every rank's shapes.

        ``m, n, k`` are the local GEMM's; ``shape`` is what must match across ranks.
        """
        proposal = self.config or select_config(m, n, k, dtype, device, num_sms=backend.num_sms,
                                                interpreter=backend.interpreter)
        if config_overrides:
            proposal = dataclasses.replace(proposal, **config_overrides)
        fused = self.policy == "fused" or (
            self.policy == "auto" and prefer_fused(m, n, k, backend.world_size, dtype,
                                                   interpreter=backend.interpreter))
        signature = (self.op_name, *shape, str(dtype), has_bias, fused)
        config = agree(backend, self._agreed, self.op_name, signature, proposal)
        return fused and m > 0 and n > 0 and k > 0, config
