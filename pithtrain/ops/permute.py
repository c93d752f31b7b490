"""Gather-based token permutation between token order and expert order.

A routed token has k slots (one per chosen expert); slot j of token t is pair p = t * k + j.
`order` [M] lists the pairs that become rows, sorted by expert (or by destination rank); `pos`
[N * k] gives each pair's row, or M for a pair that has no row (a duplicate that expert
parallelism does not send twice, or a slot owned by another rank). With every pair kept
(M = N * k, one rank) `pos` is simply the inverse permutation of `order`.

Two operations, each the other's backward, neither with an atomic add:
- `permute`: tokens [N, H] -> rows [M, H], row i a copy of token order[i] // k: each token is
  read once and written to its slots' rows (every row has exactly one pair, so each row is
  written once);
- `combine`: rows [M, H] -> tokens [N, H], token t = sum_j w[t, j] * row pos[t, j] (w = 1 when
  not given), a gather; its backward is permute's write times the weights, and in the same pass
  the weight gradient, a dot product per slot.
On CUDA these are Triton kernels that read each row once and write each token once (and the
reverse): the eager twins (`*_reference`) materialise the [N, k, H] block of a token's slots (268
MB per MoE layer for a Qwen3-30B-A3B micro-batch of 8192 tokens) and reduce it with a second
kernel.
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

def scatter_rows_reference(src, pos, k, M, weights=None):
    """dst [M, H]: dst[pos[t * k + j]] = weights[t, j] * src[t] for every pair with a row (pos < M)."""
    per_slot = src.repeat_interleave(k, dim=0)
    if weights is not None:
        per_slot = per_slot * weights.reshape(-1, 1).to(per_slot.dtype)
    keep = pos < M
    dst = src.new_zeros(M, src.shape[1])
    dst[pos[keep]] = per_slot[keep]
    return dst


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
    def _scatter_rows_kernel(src_ptr, pos_ptr, w_ptr, dst_ptr, rows_ptr, dw_ptr, M, H, K: tl.constexpr,
                             SCALE: tl.constexpr, DOTS: tl.constexpr, BLOCK: tl.constexpr):
        """Token t's row read once and written to each of its slots' rows (times its weight with
        SCALE); with DOTS (BLOCK covers the row) also dw[t, j] = rows[pos] . src[t]."""
        t, cols = tl.program_id(0).to(tl.int64), tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < H
        v = tl.load(src_ptr + t * H + cols, mask=mask, other=0.0).to(tl.float32)
        for j in range(K):
            p = tl.load(pos_ptr + t * K + j)
            row_mask = mask & (cols * 0 + p < M)  # pos = M: the pair has no row (a tile-shaped mask)
            out = v
            if SCALE:
                out = v * tl.load(w_ptr + t * K + j).to(tl.float32)
            tl.store(dst_ptr + p * H + cols, out.to(dst_ptr.dtype.element_ty), mask=row_mask)
            if DOTS:
                r = tl.load(rows_ptr + tl.where(p < M, p, 0) * H + cols, mask=row_mask, other=0.0)
                tl.store(dw_ptr + t * K + j, tl.sum(r.to(tl.float32) * v, axis=0))

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


# Columns per program and warps: the best of 8 tiles (kernels.py --sweep, H200, 2026-12-03) for the
# combine and for the gather kernel that permute used then; swept again on an H100 (2026-12-05)
# for the scatter kernel: this tile is within 1% of the best of the 8 (89% of copy).
TILE = {"block": 2048, "warps": 4}


def scatter_rows(src, pos, k, M, weights=None, rows=None):
    """`scatter_rows_reference` (each pair's row written once: no atomics); with `rows` [M, H] also
    returns `slot_dots_reference(rows, src, pos, k)`, from the same read of src."""
    if not use_triton(src):
        dst = scatter_rows_reference(src, pos, k, M, weights)
        return dst if rows is None else (dst, slot_dots_reference(rows, src, pos, k))
    src = src.contiguous()
    N, H = src.shape
    dst = src.new_empty(M, H)
    dw = torch.empty(N * k, dtype=torch.float32, device=src.device) if rows is not None else None
    block = triton.next_power_of_2(H) if rows is not None else TILE["block"]  # dots: the whole row
    if N and M:
        _scatter_rows_kernel[(N, triton.cdiv(H, block))](
            src, pos, weights.contiguous() if weights is not None else pos, dst,
            rows.contiguous() if rows is not None else src, dw if dw is not None else pos, M, H, K=k,
            SCALE=weights is not None, DOTS=rows is not None, BLOCK=block, num_warps=TILE["warps"])
    elif dw is not None:
        dw.zero_()
    return dst if rows is None else (dst, dw.view(-1, k))


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


# --- autograd ----------------------------------------------------------------------------------

class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, order, pos, k):
        ctx.save_for_backward(pos)
        ctx.k = k
        return scatter_rows(x, pos, k, order.shape[0])

    @staticmethod
    def backward(ctx, grad):
        (pos,) = ctx.saved_tensors
        return sum_slots(grad, pos, ctx.k), None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, weights, order, pos, k):
        ctx.save_for_backward(rows, weights, pos)
        ctx.k = k
        return sum_slots(rows, pos, k, weights)

    @staticmethod
    def backward(ctx, dout):
        rows, weights, pos = ctx.saved_tensors
        M = rows.shape[0]
        if not ctx.needs_input_grad[1]:
            return scatter_rows(dout, pos, ctx.k, M, weights), None, None, None, None
        drows, dweights = scatter_rows(dout, pos, ctx.k, M, weights, rows=rows)
        return drows, dweights.to(weights.dtype), None, None, None


def permute(x: torch.Tensor, order: torch.Tensor, pos: torch.Tensor, k: int) -> torch.Tensor:
    """Tokens x [N, H] -> rows [M, H], row i a copy of token order[i] // k."""
    return _Permute.apply(x, order, pos, k)


def combine(rows: torch.Tensor, order: torch.Tensor, pos: torch.Tensor, k: int,
            weights: torch.Tensor | None = None) -> torch.Tensor:
    """Rows [M, H] -> tokens [N, H]: each token's slot rows summed, weighted by weights [N, k] if given."""
    return _Combine.apply(rows, weights, order, pos, k)
