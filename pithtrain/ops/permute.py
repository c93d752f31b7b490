"""Gather-based token permutation between token order and expert order.

A routed token has k slots (one per chosen expert); slot j of token t is pair p = t * k + j.
`order` [M] lists the pairs that become rows, sorted by expert (or by destination rank); `pos`
[N * k] gives each pair's row, or M for a pair that has no row (a duplicate that expert
parallelism does not send twice, or a slot owned by another rank). With every pair kept
(M = N * k, one rank) `pos` is simply the inverse permutation of `order`.

Two operations, each the other's backward, both gathers (no scatter-add, so no atomics):
- `permute`: tokens [N, H] -> rows [M, H], row i a copy of token order[i] // k;
- `combine`: rows [M, H] -> tokens [N, H], token t = sum_j w[t, j] * row pos[t, j] (w = 1 when
  not given); its weight gradient is a dot product per slot.
On CUDA these are Triton kernels that read each row once and write each token once: the eager
twins (`*_reference`) materialise the [N, k, H] block of a token's slots (268 MB per MoE layer for
a Qwen3-30B-A3B micro-batch of 8192 tokens) and reduce it with a second kernel.
"""

import torch

from pithtrain.ops import triton, use_triton

if triton is not None:
    import triton.language as tl


def count(values: torch.Tensor, n: int) -> torch.Tensor:
    """Occurrences of 0..n-1 in `values` (int64 [n]). Unlike `torch.bincount`, which sizes its output
    from the largest value, this never reads a value back to the host (no CUDA synchronisation)."""
    flat = values.reshape(-1)
    return torch.zeros(n, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def sort_by_expert(expert_ids: torch.Tensor, num_experts: int):
    """expert_ids [N, k] -> (order, inverse, counts [num_experts]) with a stable sort.

    The sort keys are int16 when the experts allow it: a radix sort makes one pass per key byte,
    2 instead of 8 for int64. The inverse permutation is a scatter, not a second sort."""
    flat = expert_ids.reshape(-1)
    keys = flat.to(torch.int16) if num_experts <= torch.iinfo(torch.int16).max else flat
    order = torch.argsort(keys, stable=True)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.shape[0], device=order.device))
    return order, inverse, count(flat, num_experts)


# --- torch twins -------------------------------------------------------------------------------

def gather_rows_reference(src, order, k, scale=None):
    """dst[i] = scale[i] * src[order[i] // k]."""
    out = src.index_select(0, torch.div(order, k, rounding_mode="floor"))
    return out if scale is None else out * scale[:, None].to(out.dtype)


def _slots(rows, pos):
    if pos.shape[0] != rows.shape[0]:  # some pairs have no row: append the zero row they point at
        rows = torch.cat([rows, rows.new_zeros(1, rows.shape[1])])
    return rows.index_select(0, pos)


def sum_slots_reference(rows, pos, k, weights=None):
    """out[t] = sum_j weights[t, j] * rows[pos[t * k + j]] (a zero row where pos is M)."""
    per_slot = _slots(rows, pos).view(-1, k, rows.shape[1])
    if weights is None:
        return per_slot.sum(1)
    return torch.bmm(weights.unsqueeze(1).to(per_slot.dtype), per_slot).squeeze(1)


def slot_dots_reference(rows, dout, pos, k):
    """d weights[t, j] = rows[pos[t * k + j]] . dout[t]."""
    per_slot = _slots(rows, pos).view(-1, k, rows.shape[1])
    return (per_slot.float() * dout.float()[:, None, :]).sum(-1)


# --- Triton kernels ----------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _gather_rows_kernel(src_ptr, order_ptr, scale_ptr, dst_ptr, H, K: tl.constexpr, SCALE: tl.constexpr,
                            BLOCK: tl.constexpr):
        i, cols = tl.program_id(0).to(tl.int64), tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < H
        pair = tl.load(order_ptr + i)
        v = tl.load(src_ptr + (pair // K) * H + cols, mask=mask).to(tl.float32)
        if SCALE:
            v = v * tl.load(scale_ptr + i).to(tl.float32)
        tl.store(dst_ptr + i * H + cols, v.to(dst_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _sum_slots_kernel(rows_ptr, pos_ptr, w_ptr, out_ptr, M, H, K: tl.constexpr, WEIGHTED: tl.constexpr,
                          BLOCK: tl.constexpr):
        t, cols = tl.program_id(0).to(tl.int64), tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < H
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in range(K):
            p = tl.load(pos_ptr + t * K + j)
            keep = (p < M).to(tl.float32)  # pos = M: no row, the slot adds zero
            v = tl.load(rows_ptr + tl.where(p < M, p, 0) * H + cols, mask=mask, other=0.0).to(tl.float32) * keep
            if WEIGHTED:
                v = v * tl.load(w_ptr + t * K + j).to(tl.float32)
            acc += v
        tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _slot_dots_kernel(rows_ptr, dout_ptr, pos_ptr, dw_ptr, M, H, K: tl.constexpr, BLOCK_H: tl.constexpr):
        pair = tl.program_id(0).to(tl.int64)
        p = tl.load(pos_ptr + pair)
        cols = tl.arange(0, BLOCK_H)  # the whole row at once (BLOCK_H: H rounded up to a power of 2)
        mask = cols < H
        r = tl.load(rows_ptr + tl.where(p < M, p, 0) * H + cols, mask=mask, other=0.0).to(tl.float32)
        d = tl.load(dout_ptr + (pair // K) * H + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(dw_ptr + pair, tl.sum(r * d, axis=0) * (p < M).to(tl.float32))


TILE = {"block": 2048, "warps": 4}  # columns per program, warps: the best of 8 in benchmarks/kernels.py --sweep (H200)


def gather_rows(src, order, k, scale=None):
    if not use_triton(src):
        return gather_rows_reference(src, order, k, scale)
    src = src.contiguous()
    H = src.shape[1]
    dst = src.new_empty(order.shape[0], H)
    if order.shape[0]:
        _gather_rows_kernel[(order.shape[0], triton.cdiv(H, TILE["block"]))](
            src, order, scale if scale is not None else order, dst, H, K=k, SCALE=scale is not None,
            BLOCK=TILE["block"], num_warps=TILE["warps"])
    return dst


def sum_slots(rows, pos, k, weights=None):
    if not use_triton(rows) or rows.shape[0] == 0:  # no rows at all: the twin gives the zeros
        return sum_slots_reference(rows, pos, k, weights)
    rows = rows.contiguous()
    H, N = rows.shape[1], pos.shape[0] // k
    out = rows.new_empty(N, H)
    if N:
        _sum_slots_kernel[(N, triton.cdiv(H, TILE["block"]))](
            rows, pos, weights.contiguous() if weights is not None else pos, out, rows.shape[0], H, K=k,
            WEIGHTED=weights is not None, BLOCK=TILE["block"], num_warps=TILE["warps"])
    return out


def slot_dots(rows, dout, pos, k):
    if not use_triton(rows) or rows.shape[0] == 0:
        return slot_dots_reference(rows, dout, pos, k)
    dw = torch.empty(pos.shape[0], dtype=torch.float32, device=rows.device)
    if pos.shape[0]:
        _slot_dots_kernel[(pos.shape[0],)](rows.contiguous(), dout.contiguous(), pos, dw, rows.shape[0],
                                           rows.shape[1], K=k, BLOCK_H=triton.next_power_of_2(rows.shape[1]))
    return dw.view(-1, k)


# --- autograd ----------------------------------------------------------------------------------

class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, order, pos, k):
        ctx.save_for_backward(pos)
        ctx.k = k
        return gather_rows(x, order, k)

    @staticmethod
    def backward(ctx, grad):
        (pos,) = ctx.saved_tensors
        return sum_slots(grad, pos, ctx.k), None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, weights, order, pos, k):
        ctx.save_for_backward(rows, weights, order, pos)
        ctx.k = k
        return sum_slots(rows, pos, k, weights)

    @staticmethod
    def backward(ctx, dout):
        rows, weights, order, pos = ctx.saved_tensors
        k = ctx.k
        scale = weights.reshape(-1).index_select(0, order) if weights is not None else None
        drows = gather_rows(dout, order, k, scale)
        dweights = slot_dots(rows, dout, pos, k).to(weights.dtype) if ctx.needs_input_grad[1] else None
        return drows, dweights, None, None, None


def permute(x: torch.Tensor, order: torch.Tensor, pos: torch.Tensor, k: int) -> torch.Tensor:
    """Tokens x [N, H] -> rows [M, H], row i a copy of token order[i] // k."""
    return _Permute.apply(x, order, pos, k)


def combine(rows: torch.Tensor, order: torch.Tensor, pos: torch.Tensor, k: int,
            weights: torch.Tensor | None = None) -> torch.Tensor:
    """Rows [M, H] -> tokens [N, H]: each token's slot rows summed, weighted by weights [N, k] if given."""
    return _Combine.apply(rows, weights, order, pos, k)
