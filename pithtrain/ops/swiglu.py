"""Gated activations of the expert and dense MLPs, on the fused [.., 2 * I] gate/up projection.

- `swiglu`: halves [gate | up] (Qwen3, DeepSeek): silu(gate) * up.
- `clamped_swiglu`: interleaved [g0, u0, g1, u1, ...] (GPT-OSS): gate clamped above at `limit`,
  up clamped to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate).
"""

import torch
import torch.nn.functional as F


def swiglu(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def clamped_swiglu(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    gate, up = x[..., 0::2].clamp(max=limit), x[..., 1::2].clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(alpha * gate)
