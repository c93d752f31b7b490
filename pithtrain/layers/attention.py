"""Self-attention: grouped-query attention (Qwen3, GPT-OSS) and multi-head latent attention
(DeepSeek-V2/V3), both through `attend`, the one place where scores are computed (SDPA).

`attend` options:
- `window`: sliding-window causal attention; a query sees itself and the `window - 1` keys
  before it (GPT-OSS's sliding layers).
- `sinks`: one learned logit per query head that joins every softmax row and takes probability
  mass but has no value (GPT-OSS). It is run through SDPA by adding a key: the query gains one
  more dimension holding sink/scale, every real key holds 0 there, and an extra key (visible to
  all queries, value 0) holds 1 there and 0 elsewhere, so its score is exactly the sink logit.
"""

import torch
import torch.nn.functional as F
from torch import nn

from pithtrain.layers.norm import RMSNorm
from pithtrain.layers.rope import apply_rope


def _mask(S: int, window: int | None, sink: bool, device) -> torch.Tensor:
    """Boolean [S, S (+1)] mask, True where attention is allowed; with `sink` column 0 is the sink."""
    q = torch.arange(S, device=device)[:, None]
    k = torch.arange(S, device=device)[None, :]
    allowed = k <= q
    if window is not None:
        allowed &= k > q - window
    if sink:
        allowed = torch.cat([torch.ones(S, 1, dtype=torch.bool, device=device), allowed], dim=1)
    return allowed


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
           window: int | None = None, sinks: torch.Tensor | None = None, ctx=None) -> torch.Tensor:
    """Causal attention. q [B, Hq, S, D], k [B, Hk, S, D], v [B, Hk, S, Dv] -> [B, S, Hq * Dv].
    Under context parallelism (`ctx.cp` set) S is this rank's two blocks and the ring attention
    of `parallel/context.py` sees the rest of the sequence."""
    B, Hq, S, D = q.shape
    Hk = k.shape[1]
    scale = D ** -0.5 if scale is None else scale
    if ctx is not None and ctx.cp is not None:
        from pithtrain.parallel.context import ring_attention

        out = ring_attention(q, k, v, ctx.cp, scale=scale, window=window, sinks=sinks)
        return out.transpose(1, 2).reshape(B, S, -1)
    if window is None and sinks is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=Hk != Hq)
        return out.transpose(1, 2).reshape(B, S, -1)
    if Hk != Hq:  # explicit masks: expand the kv heads rather than rely on GQA support per backend
        k, v = k.repeat_interleave(Hq // Hk, dim=1), v.repeat_interleave(Hq // Hk, dim=1)
    if sinks is not None:
        pad = -(D + 1) % 8 + 1  # keep the head size a multiple of 8 for the fused kernels
        extra = q.new_zeros(B, Hq, S, pad)
        extra[..., 0] = (sinks / scale).to(q.dtype)[None, :, None]
        q = torch.cat([q, extra], dim=-1)
        k = torch.cat([k, k.new_zeros(B, Hq, S, pad)], dim=-1)
        sink_key = k.new_zeros(B, Hq, 1, D + pad)
        sink_key[..., D] = 1
        k = torch.cat([sink_key, k], dim=2)
        v = torch.cat([v.new_zeros(B, Hq, 1, v.shape[-1]), v], dim=2)
    mask = _mask(S, window, sinks is not None, q.device)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.transpose(1, 2).reshape(B, S, -1)


class GQAttention(nn.Module):
    """Causal GQA: `heads` query heads share `kv_heads` key/value heads of size `head_dim`.
    Options: biases, per-head q/k RMSNorm (Qwen3), a sliding window and sinks (GPT-OSS)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, *, bias: bool = False,
                 qk_norm: bool = False, eps: float = 1e-6, window: int | None = None, sinks: bool = False):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.window = heads, kv_heads, head_dim, window
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=bias)
        self.q_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.sinks = nn.Parameter(torch.empty(heads)) if sinks else None

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        B, S, _ = x.shape
        cos, sin = ctx.cos, ctx.sin
        q = self.q_proj(x).view(B, S, self.heads, self.head_dim)
        k = self.k_proj(x).view(B, S, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, S, self.kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self.o_proj(attend(q, k, v, window=self.window, sinks=self.sinks, ctx=ctx))


class MLAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2). Queries: one projection, or a low-rank one
    (`q_lora_rank`: q_a_proj -> RMSNorm -> q_b_proj). Keys and values: a shared latent of
    `kv_lora_rank` (kv_a_proj_with_mqa, which also yields one rotary key of `rope_dim` shared by
    all heads) -> RMSNorm -> kv_b_proj to per-head no-rope keys and values. Each head's key is
    [no-rope part (nope_dim), shared rotary part (rope_dim)]."""

    def __init__(self, hidden: int, heads: int, *, q_lora_rank: int | None, kv_lora_rank: int, nope_dim: int,
                 rope_dim: int, v_dim: int, scale: float, bias: bool = False, interleaved: bool = True):
        super().__init__()
        self.heads, self.nope_dim, self.rope_dim, self.v_dim = heads, nope_dim, rope_dim, v_dim
        self.kv_lora_rank, self.scale, self.interleaved = kv_lora_rank, scale, interleaved
        qk_dim = nope_dim + rope_dim
        if q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, heads * qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank)
            self.q_b_proj = nn.Linear(q_lora_rank, heads * qk_dim, bias=False)
        self.q_lora = q_lora_rank is not None
        self.kv_a_proj_with_mqa = nn.Linear(hidden, kv_lora_rank + rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank)
        self.kv_b_proj = nn.Linear(kv_lora_rank, heads * (nope_dim + v_dim), bias=False)
        self.o_proj = nn.Linear(heads * v_dim, hidden, bias=bias)

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        B, S, _ = x.shape
        cos, sin = ctx.cos, ctx.sin
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q = q.view(B, S, self.heads, -1).transpose(1, 2)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(B, S, self.heads, -1).transpose(1, 2)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        q_rope = apply_rope(q_rope, cos, sin, self.interleaved)
        k_rope = apply_rope(k_rope.view(B, 1, S, self.rope_dim), cos, sin, self.interleaved)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(B, self.heads, S, self.rope_dim)], dim=-1)
        return self.o_proj(attend(q, k, v, scale=self.scale, ctx=ctx))
