"""Rotary position embedding: plain RoPE and YaRN, read from a Hugging Face config.

`rope_parameters(hf)` gathers the RoPE fields of a config.json, old style (`rope_theta`,
`rope_scaling` at the top level) or new style (`rope_parameters`), not both (transformers would
drop `rope_parameters`); a top-level `original_max_position_embeddings` wins over YaRN's own, as
in transformers. YaRN (arXiv 2309.00071)
blends interpolated and original frequencies along a ramp between the dimensions that turn
`beta_fast` and `beta_slow` times over the original context, and scales cos/sin by an attention
factor: `attention_factor` if given, else mscale(factor, mscale) / mscale(factor, mscale_all_dim)
when both are given, else mscale(factor) with mscale(s, m) = 0.1 * m * ln(s) + 1 (1 for s <= 1).
DeepSeek's attention additionally multiplies its softmax scale by mscale(factor, mscale_all_dim)^2
(`yarn_softmax_scale`). These are the formulas of the DeepSeek and GPT-OSS releases as
`transformers` implements them; the HF parity tests hold us to them.
"""

import math

import torch
from torch import nn


def rope_parameters(hf: dict) -> dict:
    """The RoPE fields of a config.json as one dict with `rope_type` and `rope_theta` set."""
    scaling = hf.get("rope_scaling") or {}
    if not isinstance(scaling, dict) or (scaling and not {"rope_type", "type"} & scaling.keys()):
        raise ValueError(f"rope_scaling = {scaling!r} must be a table that names its rope_type, e.g. "
                         "{rope_type = 'yarn', factor = 4.0, original_max_position_embeddings = 4096}")
    if scaling and hf.get("rope_parameters"):  # transformers would take rope_scaling alone, theta included
        raise ValueError("config.json has both rope_scaling and rope_parameters (transformers reads rope_scaling "
                         "alone and drops rope_parameters, its rope_theta too): keep one of them")
    params = dict(hf.get("rope_parameters") or {})
    params.update(scaling)
    params.setdefault("rope_theta", hf.get("rope_theta"))
    if params["rope_theta"] is None:
        raise ValueError("config.json has no rope_theta (top level or in rope_parameters)")
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    if params["rope_type"] not in ("default", "yarn"):
        raise ValueError(f"rope type {params['rope_type']!r} is not supported; supported: 'default', 'yarn'")
    if params["rope_type"] == "yarn" and hf.get("original_max_position_embeddings"):  # the top level wins,
        params["original_max_position_embeddings"] = hf["original_max_position_embeddings"]  # as in transformers
    return params


def mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _yarn_factor(params: dict, max_positions: int | None) -> float:
    factor = params.get("factor")
    if factor is None:
        if not max_positions or not params.get("original_max_position_embeddings"):
            raise ValueError("YaRN rope scaling needs a factor, or max_position_embeddings and "
                             "original_max_position_embeddings to derive it from")
        factor = max_positions / params["original_max_position_embeddings"]
    return float(factor)


def yarn_softmax_scale(params: dict, head_dim: int, max_positions: int | None = None) -> float:
    """DeepSeek's attention scale: head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN."""
    scale = head_dim ** -0.5
    if params["rope_type"] == "yarn" and params.get("mscale_all_dim"):
        scale *= mscale(_yarn_factor(params, max_positions), params["mscale_all_dim"]) ** 2
    return scale


def inverse_frequencies(params: dict, dim: int, max_positions: int | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim/2], attention factor for cos/sin) for RoPE or YaRN."""
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if params["rope_type"] == "default":
        return inv_freq, 1.0
    factor = _yarn_factor(params, max_positions)
    original = params.get("original_max_position_embeddings") or max_positions
    attention = params.get("attention_factor")
    if attention is None:
        if params.get("mscale") and params.get("mscale_all_dim"):
            attention = mscale(factor, params["mscale"]) / mscale(factor, params["mscale_all_dim"])
        else:
            attention = mscale(factor)

    def turns_to_dim(turns: float) -> float:  # the dimension that turns `turns` times over `original`
        return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = turns_to_dim(params.get("beta_fast") or 32), turns_to_dim(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: original frequency (fast dimensions), 0: interpolated (slow ones)
    return inv_freq / factor * (1 - keep) + inv_freq * keep, float(attention)


class RotaryEmbedding(nn.Module):
    """Holds the inverse frequencies; `forward(positions)` gives (cos, sin) of shape [B, S, dim]."""

    def __init__(self, dim: int, params: dict, max_positions: int | None = None):
        super().__init__()
        if dim % 2:
            raise ValueError(f"the rotary dimension {dim} is odd: RoPE rotates pairs of dimensions, so the "
                             "model's head_dim (qk_rope_head_dim for MLA) must be even")
        self.dim, self.params, self.max_positions = dim, params, max_positions
        inv_freq, self.attention_factor = inverse_frequencies(params, dim, max_positions)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def reset(self) -> None:
        """Recompute the frequencies in place (after `to_empty` left the buffer unset)."""
        self.inv_freq.copy_(inverse_frequencies(self.params, self.dim, self.max_positions)[0])

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate x [B, heads, S, dim]. Half-split pairs (i, i + dim/2) by default; `interleaved`
    pairs (2i, 2i + 1), as DeepSeek's checkpoints lay them out: those are first gathered into the
    half-split order (the result stays in that order, which q.k products do not see)."""
    if interleaved:
        x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin
