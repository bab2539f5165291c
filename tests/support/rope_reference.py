"""A float64 reference for the rotary embedding of a fused ``q | k | v`` projection, and its tolerance."""

import torch


def tables(gen, seq: int, head_dim: int, dtype):
    """Random angles (not the model's frequencies: any rotation must come out right), as cos and sin."""
    angles = 7 * torch.rand(seq, head_dim // 2, generator=gen, dtype=torch.float64)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def reference(qkv, cos, sin, seq, heads, kv_heads, head_dim):
    """float64 ``(q, k, v)`` of ``qkv``: each head's pairs (2j, 2j + 1) as ``a + ib``, times ``exp(i angle)``."""
    m = qkv.shape[0]
    x = qkv.double().view(m, heads + 2 * kv_heads, head_dim // 2, 2)
    z = torch.complex(x[..., 0], x[..., 1])
    pos = torch.arange(m, device=qkv.device) % seq
    turn = torch.complex(cos.double(), sin.double())[pos][:, None, :]
    rotated = torch.view_as_real(z[:, :heads + kv_heads] * turn).reshape(m, -1)
    q = rotated[:, :heads * head_dim]
    k = rotated[:, heads * head_dim:]
    v = qkv.double()[:, (heads + kv_heads) * head_dim:]
    return q, k, v


def close(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    # a sum of two products rounded once, of operands rounded to the dtype (the tables too): a few units
    # of the last place of the pair's length |a + ib| (which bounds |a cos| + |b sin|)
    eps = torch.finfo(got.dtype).eps
    err = (got.double() - want).abs()
    pairs = want.reshape(*want.shape[:-1], -1, 2)
    length = pairs.norm(dim=-1, keepdim=True).expand_as(pairs).reshape(want.shape)
    bound = 4 * eps * length + 1e-300
    assert bool((err <= bound).all()), (name, float((err - bound).max()), got.dtype)
