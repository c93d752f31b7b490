"""Self-attention: grouped-query attention (Qwen3, GPT-OSS) and multi-head latent attention
(DeepSeek-V2/V3), both through `attend`, the one place where scores are computed.

`attend` options:
- `window`: sliding-window causal attention; a query sees itself and the `window - 1` keys
  before it (GPT-OSS's sliding layers).
- `sinks`: one learned logit per query head that joins every softmax row and takes probability
  mass but has no value (GPT-OSS).
- `ctx.docs` (document masking of packed sequences, [B, S] document index): a query sees only
  keys of its own document.

Backends, chosen per call:
- plain causal attention: SDPA (on the H200 torch picks cuDNN's kernel, ~400 TFLOP/s fwd+bwd on
  Qwen3's shape against ~215 for flash; benchmarks/kernels.py measures both);
- any mask option on CUDA: FlexAttention (compiled once; `CausalLM.context` makes the block masks
  of a micro-batch and hands them over in `ctx.masks`), whose block mask skips the key blocks a
  window or a document boundary rules out, instead of computing the whole S x S square. Sinks are
  applied to its output exactly: with Z the sum of exp(scores) of a row and lse = log Z, the sink
  adds exp(sink) to the denominator, so out = out_flex * Z / (Z + exp(sink)) = out_flex *
  sigmoid(lse - sink), and the gradient flows through lse as well;
- any mask option elsewhere (CPU): SDPA with an explicit boolean mask; sinks join as an extra key:
  the query gains one dimension holding sink/scale, every real key holds 0 there, and an extra key
  (visible to all queries, value 0) holds 1 there and 0 elsewhere, so its score is the sink logit.
"""

import torch
import torch.nn.functional as F
from torch import nn

from pithtrain.layers.norm import RMSNorm
from pithtrain.layers.rope import apply_rope


def _mask(S: int, window: int | None, sink: bool, device, docs: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean [S, S (+1)] mask ([B, 1, S, S (+1)] with `docs`), True where attention is allowed;
    with `sink` column 0 is the sink."""
    q = torch.arange(S, device=device)[:, None]
    k = torch.arange(S, device=device)[None, :]
    allowed = k <= q
    if window is not None:
        allowed &= k > q - window
    if docs is not None:
        allowed = (allowed & (docs[:, :, None] == docs[:, None, :]))[:, None]
    if sink:
        allowed = torch.cat([torch.ones(*allowed.shape[:-1], 1, dtype=torch.bool, device=device), allowed], dim=-1)
    return allowed


_flex = None
_causal_masks: dict = {}


def block_masks(windows: set, batch: int, S: int, docs: torch.Tensor | None, device) -> dict:
    """FlexAttention block masks, one per window size in `windows` (None: full causal), for
    `batch` sequences of S tokens, with documents if `docs` [B, S] is given. Made once per
    micro-batch outside any compiled region; those without documents are cached.

    Every mask uses one mask function whose window and documents are tensors it captures: the
    compiled attention treats captured tensors as inputs but takes a mask function's Python
    values as constants of the first graph it compiled, so two windows written as Python ints
    would share the first one's mask (measured: a 64-token window computed as 128)."""
    from torch.nn.attention.flex_attention import create_block_mask

    out = {}
    for window in windows:
        key = (batch, S, window, str(device))
        if docs is None and key in _causal_masks:
            out[window] = _causal_masks[key]
            continue
        span = torch.full((), S + 1 if window is None else window, device=device)  # a fill: no host copy, so capturable
        doc = docs if docs is not None else torch.zeros(batch, S, dtype=torch.long, device=device)

        def allowed(b, h, qi, ki, span=span, doc=doc):
            return (ki <= qi) & (ki > qi - span) & (doc[b, qi] == doc[b, ki])

        out[window] = create_block_mask(allowed, batch, None, S, S, device=device)
        if docs is None:
            _causal_masks[key] = out[window]
    return out


def _flex_fits(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Head sizes FlexAttention's kernels compile for on the H200: at least 16; in fp32 at most 64
    (fp32 with MLA's 192 ran out of shared memory, 279,808 of 232,448 bytes). Others take SDPA
    with dense masks."""
    D, Dv = q.shape[-1], v.shape[-1]
    return min(D, Dv) >= 16 and (q.dtype != torch.float32 or max(D, Dv) <= 64)


def _flex_attention(q, k, v, scale: float, mask, sinks: torch.Tensor | None):
    from torch.nn.attention.flex_attention import flex_attention

    global _flex
    if _flex is None:
        _flex = torch.compile(flex_attention, fullgraph=True, dynamic=False)
    out, lse = _flex(q, k, v, block_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1], return_lse=True)
    if sinks is not None:
        out = (out.float() * torch.sigmoid(lse.float() - sinks.float()[None, :, None]).unsqueeze(-1)).to(out.dtype)
    return out


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
           window: int | None = None, sinks: torch.Tensor | None = None, ctx=None) -> torch.Tensor:
    """Causal attention. q [B, Hq, S, D], k [B, Hk, S, D], v [B, Hk, S, Dv] -> [B, S, Hq * Dv].
    Under context parallelism (`ctx.cp` set) S is this rank's two blocks and the ring attention
    of `parallel/context.py` sees the rest of the sequence."""
    B, Hq, S, D = q.shape
    Hk = k.shape[1]
    scale = D ** -0.5 if scale is None else scale
    docs = getattr(ctx, "docs", None)
    if ctx is not None and ctx.cp is not None:
        from pithtrain.parallel.context import ring_attention

        out = ring_attention(q, k, v, ctx.cp, scale=scale, window=window, sinks=sinks)
        return out.transpose(1, 2).reshape(B, S, -1)
    if window is None and sinks is None and docs is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=Hk != Hq)
        return out.transpose(1, 2).reshape(B, S, -1)
    masks = getattr(ctx, "masks", None)
    if masks is not None and _flex_fits(q, v):  # FlexAttention (CUDA)
        return _flex_attention(q, k, v, scale, masks[window], sinks).transpose(1, 2).reshape(B, S, -1)
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
    mask = _mask(S, window, sinks is not None, q.device, docs)
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
