"""Gated activations of the expert and dense MLPs, on the fused [.., 2 * I] gate/up projection.

- `swiglu`: halves [gate | up] (Qwen3, DeepSeek): silu(gate) * up.
- `clamped_swiglu`: interleaved [g0, u0, g1, u1, ...] (GPT-OSS): gate clamped above at `limit`,
  up clamped to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate).

Both are out = (u + beta) * g * sigmoid(alpha * g) on (optionally clamped) g, u. On CUDA one
Triton kernel computes the forward and one the backward. Eager PyTorch runs silu, then the
product (and the clamps) as separate kernels and saves three [rows, I] tensors for backward; the
kernels read the projection once, write the output once, and save only the projection itself:
the sigmoid is recomputed in backward (a few flops per element on a memory-bound op), so memory
traffic and saved activations both drop. `*_reference` are the torch twins; elsewhere (CPU)
the twins run.
"""

import torch
import torch.nn.functional as F

from pithtrain.ops import triton, use_triton

if triton is not None:
    import triton.language as tl


def swiglu_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def clamped_swiglu_reference(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    gate, up = x[..., 0::2].clamp(max=limit), x[..., 1::2].clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(alpha * gate)


if triton is not None:

    @triton.jit
    def _load_gate_up(x_ptr, row, cols, mask, width, INTERLEAVED: tl.constexpr):
        base = x_ptr + row * 2 * width
        if INTERLEAVED:
            g = tl.load(base + 2 * cols, mask=mask).to(tl.float32)
            u = tl.load(base + 2 * cols + 1, mask=mask).to(tl.float32)
        else:
            g = tl.load(base + cols, mask=mask).to(tl.float32)
            u = tl.load(base + width + cols, mask=mask).to(tl.float32)
        return g, u

    @triton.jit
    def _gated_forward(x_ptr, out_ptr, width, alpha, beta, limit, INTERLEAVED: tl.constexpr,
                       CLAMP: tl.constexpr, BLOCK: tl.constexpr):
        row, cols = tl.program_id(0).to(tl.int64), tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < width
        g, u = _load_gate_up(x_ptr, row, cols, mask, width, INTERLEAVED)
        if CLAMP:
            g = tl.minimum(g, limit)
            u = tl.minimum(tl.maximum(u, -limit), limit)
        out = (u + beta) * g * tl.sigmoid(alpha * g)
        tl.store(out_ptr + row * width + cols, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _gated_backward(x_ptr, dout_ptr, dx_ptr, width, alpha, beta, limit, INTERLEAVED: tl.constexpr,
                        CLAMP: tl.constexpr, BLOCK: tl.constexpr):
        row, cols = tl.program_id(0).to(tl.int64), tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < width
        g, u = _load_gate_up(x_ptr, row, cols, mask, width, INTERLEAVED)
        dout = tl.load(dout_ptr + row * width + cols, mask=mask).to(tl.float32)
        g_pass, u_pass = 1.0, 1.0
        if CLAMP:  # the gradient passes where the clamp did not bite (boundaries included, as in torch)
            g_pass = tl.where(g <= limit, 1.0, 0.0)
            u_pass = tl.where((u >= -limit) & (u <= limit), 1.0, 0.0)
            g = tl.minimum(g, limit)
            u = tl.minimum(tl.maximum(u, -limit), limit)
        s = tl.sigmoid(alpha * g)
        dg = dout * (u + beta) * (s + alpha * g * s * (1.0 - s)) * g_pass
        du = dout * g * s * u_pass
        base = dx_ptr + row * 2 * width
        if INTERLEAVED:
            tl.store(base + 2 * cols, dg.to(dx_ptr.dtype.element_ty), mask=mask)
            tl.store(base + 2 * cols + 1, du.to(dx_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(base + cols, dg.to(dx_ptr.dtype.element_ty), mask=mask)
            tl.store(base + width + cols, du.to(dx_ptr.dtype.element_ty), mask=mask)


_BLOCK = 1024


class _Gated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, alpha, beta, limit, interleaved):
        x = x.contiguous()
        rows, width = x.shape[0], x.shape[1] // 2
        out = x.new_empty(rows, width)
        clamp = limit is not None
        grid = (rows, triton.cdiv(width, _BLOCK))
        if rows:
            _gated_forward[grid](x, out, width, alpha, beta, limit if clamp else 0.0, INTERLEAVED=interleaved,
                                 CLAMP=clamp, BLOCK=_BLOCK)
        ctx.save_for_backward(x)
        ctx.args = (alpha, beta, limit, interleaved)
        return out

    @staticmethod
    def backward(ctx, dout):
        (x,) = ctx.saved_tensors
        alpha, beta, limit, interleaved = ctx.args
        rows, width = x.shape[0], x.shape[1] // 2
        dx = torch.empty_like(x)
        clamp = limit is not None
        if rows:
            _gated_backward[(rows, triton.cdiv(width, _BLOCK))](x, dout.contiguous(), dx, width, alpha, beta,
                                                               limit if clamp else 0.0, INTERLEAVED=interleaved,
                                                               CLAMP=clamp, BLOCK=_BLOCK)
        return dx, None, None, None, None


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """[rows, 2I] halves [gate | up] -> [rows, I]."""
    if use_triton(x):
        return _Gated.apply(x, 1.0, 0.0, None, False)
    return swiglu_reference(x)


def clamped_swiglu(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """[rows, 2I] interleaved gate/up -> [rows, I], GPT-OSS's activation."""
    if use_triton(x):
        return _Gated.apply(x, float(alpha), 1.0, float(limit), True)
    return clamped_swiglu_reference(x, alpha, limit)
