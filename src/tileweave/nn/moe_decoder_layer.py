"""A TP decoder layer whose MLP is a mixture of SwiGLU experts (Mixtral, Qwen3-MoE): the attention of
``tileweave.nn.decoder_layer.TPDecoderLayer``, the MLP a ``tileweave.nn.moe.TPMoE``.

    x' = h + sum_j wt[j] * down_e(silu(gate_e(rms_norm(h))) * up_e(rms_norm(h))),  e = ids[j]
    wt, ids = topk(softmax(router(rms_norm(h))), k)   # wt renormalised to sum 1 with normalize_topk

Rank r holds every expert's features ``[r*ffn/W, (r+1)*ffn/W)`` (gate and up rows, down columns) and
the whole router. The two ways to run, as the dense layer's:

* **sequence-parallel** (prefill): ``TPMoE``'s forward on this rank's rows ``[M/W, H]`` (the MoE pair:
  AllGather + grouped GEMM, grouped GEMM + ReduceScatter, a collective routing plan);
* **replicated** (decode, and prefill otherwise): ``TPMoE.replicated`` on all rows ``[M, H]``: a local
  plan, both grouped GEMMs on this rank's features, then one all-reduce of the partials that also adds
  the residual and applies the next RMSNorm (``GemmAllReduce.all_reduce``). Graphable like the dense
  decode step (``TILEWEAVE_GRAPHABLE=1``).

Checkpoint names (``MoEConfig.naming``): Mixtral's ``block_sparse_moe.gate.weight [E, H]`` and
``block_sparse_moe.experts.{e}.w1.weight`` (gate ``[F, H]``), ``w3`` (up ``[F, H]``), ``w2`` (down
``[H, F]``); Qwen3-MoE's ``mlp.gate.weight`` and ``mlp.experts.{e}.gate_proj/up_proj/down_proj.weight``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tileweave.nn.checkpoint import Reader
from tileweave.nn.decoder_layer import DecoderOps, TPDecoderLayer
from tileweave.nn.moe import TPMoE

NAMES = {"mixtral": ("block_sparse_moe.", "w1", "w3", "w2"),
         "qwen3_moe": ("mlp.", "gate_proj", "up_proj", "down_proj")}
"""Per naming: the MLP's prefix and the names of an expert's gate, up and down projections."""


class TPMoEDecoderLayer(TPDecoderLayer):
    """One layer with a ``TPMoE`` MLP (module docstring); ``config.moe`` says its experts."""

    def init_mlp(self, group: dist.ProcessGroup | None, kw: dict) -> None:
        c, moe = self.config, self.config.moe
        self.moe = TPMoE(c.hidden, c.ffn, moe.experts, moe.top_k, group=group, normalize_topk=moe.normalize_topk,
                         **kw)

    def mlp_replicated(self, normed: torch.Tensor, resid: torch.Tensor, next_norm: torch.Tensor, ops: DecoderOps,
                       group: dist.ProcessGroup) -> tuple[torch.Tensor, torch.Tensor]:
        return self.moe.replicated(normed, residual=resid, norm_weight=next_norm, eps=self.config.norm_eps)

    def mlp_sequence_parallel(self, x_shard: torch.Tensor, ops: DecoderOps, group: dist.ProcessGroup) -> torch.Tensor:
        return self.moe(x_shard)

    def _names(self, prefix: str) -> tuple[str, tuple[str, str, str]]:
        block, gate, up, down = NAMES[self.config.moe.naming]
        return prefix + block, (gate, up, down)

    def load_mlp(self, read: Reader, prefix: str) -> None:
        c, e, f = self.config, self.config.moe.experts, self.moe.ffn_local
        block, (gate, up, down) = self._names(prefix)
        f0, h = self.rank * f, c.hidden
        self.moe.router.weight.copy_(read(block + "gate.weight", (e, h)))
        for i in range(e):
            expert = f"{block}experts.{i}."
            self.moe.w0[i, :f].copy_(read(f"{expert}{gate}.weight", (c.ffn, h), 0, f0, f0 + f))
            self.moe.w0[i, f:].copy_(read(f"{expert}{up}.weight", (c.ffn, h), 0, f0, f0 + f))
            self.moe.w1[i].copy_(read(f"{expert}{down}.weight", (h, c.ffn), 1, f0, f0 + f))

    @torch.no_grad()
    def mlp_full_state(self, prefix: str, group: dist.ProcessGroup) -> dict[str, torch.Tensor]:
        block, (gate, up, down) = self._names(prefix)
        full = self.moe.full_state_dict()
        out = {block + "gate.weight": full["router.weight"]}
        for i in range(self.config.moe.experts):
            expert = f"{block}experts.{i}."
            out[f"{expert}{gate}.weight"] = full["experts.gate"][i].clone()
            out[f"{expert}{up}.weight"] = full["experts.up"][i].clone()
            out[f"{expert}{down}.weight"] = full["experts.down"][i].clone()
        return out
