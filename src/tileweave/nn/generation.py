"""Generation on the TP decoder: a batch continued greedily or by sampling, on a preallocated KV cache,
with the decode step run eagerly or captured once in a CUDA graph and replayed.

Every rank runs the same loop on the same logits (bitwise the same on every rank), so every rank chooses
the same tokens: greedy choice is an arg-max, and sampling draws from a generator seeded alike on every
rank (``seed``), on the model's device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from tileweave.nn.kv_cache import KVCache
from tileweave.nn.shards import gather_shards


def choose(logits: torch.Tensor, *, temperature: float = 0.0, top_p: float = 1.0,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token ``[B]`` of each row of ``logits [B, V]``: the arg-max at ``temperature == 0``,
    else a draw from ``softmax(logits / temperature)`` restricted to the smallest set of most likely
    tokens whose probabilities sum to at least ``top_p`` (nucleus sampling)."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1:
        ranked, order = probs.sort(dim=-1, descending=True)
        above = ranked.cumsum(-1) - ranked       # the mass of the tokens ranked before each one
        probs = torch.zeros_like(probs).scatter(-1, order, ranked.masked_fill(above >= top_p, 0))
    # Exponential race: argmax p_i / E_i with E_i ~ Exp(1) picks i with probability p_i / sum(p), one
    # draw per token and no host sync (torch.multinomial syncs on CUDA).
    race = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / race).argmax(-1)


class DecodeStep:
    """``step(tokens [B]) -> logits [B, V]``: one decode step of ``model`` on ``cache``. With
    ``cuda_graph``, the first step runs eagerly (the ops' first call of a shape must) and the next is
    captured once in a CUDA graph, then replayed: the layers and the LM head's GEMM in the graph, the
    gather of the vocabulary over the ranks after it. The graph's steps attend over the whole cache
    (masked), so that every step has the same shapes. Capture needs graphable ops
    (``TILEWEAVE_GRAPHABLE=1`` for the shared ops, or graphable ones in ``DecoderOps``)."""

    def __init__(self, model, cache: KVCache, *, cuda_graph: bool = False) -> None:
        if cuda_graph and cache.k.device.type != "cuda":
            raise ValueError(f"cuda_graph=True needs a model on a CUDA device, got {cache.k.device}")
        self.model, self.cache, self.cuda_graph = model, cache, cuda_graph
        self.graph: torch.cuda.CUDAGraph | None = None
        self.tokens: torch.Tensor | None = None
        self.shard: torch.Tensor | None = None
        self.eager_steps = 0

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        model, cache = self.model, self.cache
        if not self.cuda_graph:
            return model.decode(tokens, cache)
        model._check(tokens.view(-1, 1), cache, None)
        if self.graph is None and self.eager_steps == 0:
            shard = model.decode_shard(tokens, cache, cache.max_seq)
            self.eager_steps += 1
        else:
            if self.graph is None:
                self._capture(tokens)
            self.tokens.copy_(tokens)
            self.graph.replay()
            shard = self.shard
        cache.advance(1)
        return gather_shards(shard, 1, model.group)

    def _capture(self, tokens: torch.Tensor) -> None:
        self.tokens = tokens.clone()
        self.graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.cuda.graph(self.graph, stream=stream):
            # recorded, not run: the replay that follows runs this step
            self.shard = self.model.decode_shard(self.tokens, self.cache, self.cache.max_seq)
        torch.cuda.current_stream().wait_stream(stream)


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, max_new_tokens: int, *, attention_mask: torch.Tensor | None = None,
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, stop_tokens: Sequence[int] = (),
             pad_token_id: int | None = None, cuda_graph: bool = False,
             on_token: Callable[[int, torch.Tensor], None] | None = None) -> torch.Tensor:
    """The new tokens ``[B, n]`` that ``model`` (a ``TPDecoder``) generates after ``input_ids [B, S]``.

    ``attention_mask [B, S]``: 1 for real tokens, 0 for left padding (None: all real). ``temperature``:
    0 for greedy choice, else sampling (``choose``) with ``top_p``, from a generator seeded with ``seed``
    (the same on every rank, so every rank draws the same tokens). ``stop_tokens``: a sequence that emits
    one is finished, and its later tokens are ``pad_token_id`` (default: the first stop token); the loop
    ends when every sequence has finished, so ``n <= max_new_tokens``. ``cuda_graph``: the decode step
    replayed from a CUDA graph (``DecodeStep``). ``on_token(i, tokens [B])``: called with each step's
    tokens as they are chosen (progress, streaming; reading them waits for the GPU). The KV cache holds
    ``S + max_new_tokens`` slots, at most ``config.max_seq``. Collective: every rank must call it with the
    same arguments.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"temperature must be >= 0 and top_p in (0, 1], got {temperature} and {top_p}")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
    batch, seq = input_ids.shape
    if seq + max_new_tokens > model.config.max_seq:
        raise ValueError(f"{seq} prompt + {max_new_tokens} new tokens exceed max_seq={model.config.max_seq}")
    device = model.embed.device
    cache = model.new_cache(batch, seq + max_new_tokens)
    generator = torch.Generator(device).manual_seed(seed) if temperature > 0 else None
    stops = torch.tensor(list(stop_tokens), dtype=torch.int64, device=device)
    pad = pad_token_id if pad_token_id is not None else (int(stops[0]) if len(stop_tokens) else 0)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    step = DecodeStep(model, cache, cuda_graph=cuda_graph)
    logits = model.prefill(input_ids.to(device), cache, attention_mask)[:, -1]
    out = []
    for i in range(max_new_tokens):
        nxt = choose(logits, temperature=temperature, top_p=top_p, generator=generator)
        nxt = torch.where(finished, torch.full_like(nxt, pad), nxt)
        out.append(nxt)
        if on_token is not None:
            on_token(i, nxt)
        if len(stop_tokens):
            finished |= torch.isin(nxt, stops)
            if bool(finished.all()):
                break
        if i + 1 < max_new_tokens:
            logits = step(nxt)
    return torch.stack(out, dim=1)
