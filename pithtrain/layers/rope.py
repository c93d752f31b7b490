"""Rotary position embedding: inverse frequencies from the HF config, cos/sin tables, rotation."""

import torch
from torch import nn


def rope_theta(hf: dict) -> float:
    """`rope_theta` of a config.json, old style (top level) or new style (`rope_parameters`)."""
    params = hf.get("rope_parameters") or {}
    theta = params.get("rope_theta", hf.get("rope_theta"))
    if theta is None:
        raise ValueError("config.json has no rope_theta (top level or in rope_parameters)")
    scaling = hf.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type", params.get("rope_type", "default")))
    if kind != "default":
        raise ValueError(f"rope type {kind!r} is not supported by this model; use the default RoPE")
    return float(theta)


class RotaryEmbedding(nn.Module):
    """Holds the inverse frequencies; `forward(positions)` gives (cos, sin) of shape [B, S, dim]."""

    def __init__(self, dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, heads, S, dim] by the half-split convention (first half pairs with second half)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin
