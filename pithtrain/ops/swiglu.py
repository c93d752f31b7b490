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
    def _pairs(n_rows, width, row, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        """Interleaved layout: the tile's 2 * BLOCK contiguous columns [g0, u0, g1, u1, ...] and mask."""
        pair = tl.program_id(1) * 2 * BLOCK + tl.arange(0, 2 * BLOCK)[None, :]
        return pair, (row < n_rows) & (pair < 2 * width)

    @triton.jit
    def _load_gate_up(x_ptr, n_rows, row, cols, mask, width, INTERLEAVED: tl.constexpr, ROWS: tl.constexpr,
                      BLOCK: tl.constexpr):
        base = x_ptr + row * 2 * width
        if INTERLEAVED:  # one contiguous load, split in registers (two strided loads waste half of each)
            pair, pmask = _pairs(n_rows, width, row, ROWS, BLOCK)
            x = tl.load(base + pair, mask=pmask, other=0.0).to(tl.float32)
            g, u = tl.split(tl.reshape(x, [ROWS, BLOCK, 2]))
        else:
            g = tl.load(base + cols, mask=mask).to(tl.float32)
            u = tl.load(base + width + cols, mask=mask).to(tl.float32)
        return g, u

    @triton.jit
    def _clamp(g, u, limit):
        """GPT-OSS's clamp: gate to at most `limit`, up to [-limit, limit]; NaN stays NaN, as in torch's
        clamp (a plain min/max returns the other operand)."""
        return (tl.minimum(g, limit, propagate_nan=tl.PropagateNan.ALL),
                tl.minimum(tl.maximum(u, -limit, propagate_nan=tl.PropagateNan.ALL), limit,
                           propagate_nan=tl.PropagateNan.ALL))

    @triton.jit
    def _tile(n_rows, width, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        """[ROWS, 1] row and [1, BLOCK] column indices of this program's tile, and their mask."""
        row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)[None, :]
        return row, cols, (row < n_rows) & (cols < width)

    @triton.jit
    def _gated_forward(x_ptr, out_ptr, n_rows, width, alpha, beta, limit, INTERLEAVED: tl.constexpr,
                       CLAMP: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        row, cols, mask = _tile(n_rows, width, ROWS, BLOCK)
        g, u = _load_gate_up(x_ptr, n_rows, row, cols, mask, width, INTERLEAVED, ROWS, BLOCK)
        if CLAMP:
            g, u = _clamp(g, u, limit)
        out = (u + beta) * g * tl.sigmoid(alpha * g)
        tl.store(out_ptr + row * width + cols, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _gated_backward(x_ptr, dout_ptr, dx_ptr, n_rows, width, alpha, beta, limit, INTERLEAVED: tl.constexpr,
                        CLAMP: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        row, cols, mask = _tile(n_rows, width, ROWS, BLOCK)
        g, u = _load_gate_up(x_ptr, n_rows, row, cols, mask, width, INTERLEAVED, ROWS, BLOCK)
        dout = tl.load(dout_ptr + row * width + cols, mask=mask).to(tl.float32)
        g_pass, u_pass = 1.0, 1.0
        if CLAMP:  # the gradient passes where the clamp did not bite (boundaries included, as in torch)
            g_pass = tl.where(g <= limit, 1.0, 0.0)
            u_pass = tl.where((u >= -limit) & (u <= limit), 1.0, 0.0)
            g, u = _clamp(g, u, limit)
        s = tl.sigmoid(alpha * g)
        dg = dout * (u + beta) * (s + alpha * g * s * (1.0 - s)) * g_pass
        du = dout * g * s * u_pass
        base = dx_ptr + row * 2 * width
        if INTERLEAVED:
            pair, pmask = _pairs(n_rows, width, row, ROWS, BLOCK)
            tl.store(base + pair, tl.interleave(dg, du).to(dx_ptr.dtype.element_ty), mask=pmask)
        else:
            tl.store(base + cols, dg.to(dx_ptr.dtype.element_ty), mask=mask)
            tl.store(base + width + cols, du.to(dx_ptr.dtype.element_ty), mask=mask)


TILE = {"rows": 1, "block": 1024, "warps": 4}  # per program; no other of 12 tiles was faster (kernels.py --sweep)


def _grid(rows: int, width: int):
    return (triton.cdiv(rows, TILE["rows"]), triton.cdiv(width, TILE["block"]))


class _Gated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, alpha, beta, limit, interleaved):
        x = x.contiguous()
        rows, width = x.shape[0], x.shape[1] // 2
        out = x.new_empty(rows, width)
        clamp = limit is not None
        if rows:
            _gated_forward[_grid(rows, width)](x, out, rows, width, alpha, beta, limit if clamp else 0.0,
                                               INTERLEAVED=interleaved, CLAMP=clamp, ROWS=TILE["rows"],
                                               BLOCK=TILE["block"], num_warps=TILE["warps"])
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
            _gated_backward[_grid(rows, width)](x, dout.contiguous(), dx, rows, width, alpha, beta,
                                                limit if clamp else 0.0, INTERLEAVED=interleaved, CLAMP=clamp,
                                                ROWS=TILE["rows"], BLOCK=TILE["block"], num_warps=TILE["warps"])
        return dx, None, None, None, None


def _check_pairs(x: torch.Tensor) -> None:
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"a gated activation takes [rows, 2 x width] (gate and up values in pairs); got {list(x.shape)}")


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """[rows, 2I] halves [gate | up] -> [rows, I]."""
    _check_pairs(x)
    if use_triton(x):
        return _Gated.apply(x, 1.0, 0.0, None, False)
    return swiglu_reference(x)


def clamped_swiglu(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """[rows, 2I] interleaved gate/up -> [rows, I], GPT-OSS's activation."""
    _check_pairs(x)
    if use_triton(x):
        return _Gated.apply(x, float(alpha), 1.0, float(limit), True)
    return clamped_swiglu_reference(x, alpha, limit)
