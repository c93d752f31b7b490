"""Per-expert bias add on expert-sorted rows (GPT-OSS's gate_up_proj_bias and down_proj_bias).

Rows of expert e are rows[offsets[e-1]:offsets[e]]. Forward: out = rows + bias[expert of row].
Backward: d rows = d out, and d bias[e] = the sum of d out over expert e's segment of rows.

Eager PyTorch finds each row's expert, gathers bias[expert] into a [rows, width] tensor and adds
it (three passes), and its backward of the gather is an index_add: an atomic scatter-add of
every row into its expert's bias row, with thousands of rows landing on the same addresses. The
kernels read and write each row once in forward, and in backward one program per (expert,
column block) walks its own contiguous segment and writes its sum once: no atomics, a
deterministic order, and the gradient of the rows needs no kernel at all. `*_reference` are the
torch twins; elsewhere (CPU) the twins run.
"""

import torch

from pithtrain.ops import triton, use_triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _add_bias_kernel(rows_ptr, bias_ptr, expert_ptr, out_ptr, W, BLOCK: tl.constexpr):
        r, cols = tl.program_id(0).to(tl.int64), tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < W
        e = tl.load(expert_ptr + r).to(tl.int64)
        v = tl.load(rows_ptr + r * W + cols, mask=mask).to(tl.float32)
        b = tl.load(bias_ptr + e * W + cols, mask=mask).to(tl.float32)
        tl.store(out_ptr + r * W + cols, (v + b).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _segment_sum_kernel(dout_ptr, offsets_ptr, dbias_ptr, W, BLOCK: tl.constexpr, ROWS: tl.constexpr):
        e, cols = tl.program_id(0), tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < W
        start = tl.load(offsets_ptr + e - 1, mask=e > 0, other=0).to(tl.int64)
        end = tl.load(offsets_ptr + e).to(tl.int64)
        acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
        for r0 in range(start, end, ROWS):
            rows = r0 + tl.arange(0, ROWS)
            keep = (rows < end)[:, None] & mask[None, :]
            acc += tl.load(dout_ptr + rows[:, None] * W + cols[None, :], mask=keep, other=0.0).to(tl.float32)
        tl.store(dbias_ptr + e.to(tl.int64) * W + cols, tl.sum(acc, axis=0), mask=mask)


def row_experts(offsets: torch.Tensor, n_rows: int) -> torch.Tensor:
    """The expert of each of `n_rows` sorted rows, from the cumulative counts (on the device, no sync)."""
    return torch.searchsorted(offsets, torch.arange(n_rows, device=offsets.device, dtype=offsets.dtype), right=True)


def add_bias_reference(rows: torch.Tensor, bias: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
    return rows + bias[expert].to(rows.dtype)


def segment_sum_reference(dout: torch.Tensor, offsets: torch.Tensor, n_experts: int, expert: torch.Tensor):
    """d bias [E, W] in fp32: the sum of dout's rows per expert segment."""
    return torch.zeros(n_experts, dout.shape[1], dtype=torch.float32, device=dout.device).index_add_(
        0, expert, dout.float())


_BLOCK = 1024


class _ExpertBias(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, bias, offsets):
        expert = row_experts(offsets, rows.shape[0])
        ctx.save_for_backward(offsets, expert)
        ctx.bias_dtype = bias.dtype
        if not use_triton(rows) or rows.shape[0] == 0:
            return add_bias_reference(rows, bias, expert)
        rows, bias = rows.contiguous(), bias.contiguous()
        out = torch.empty_like(rows)
        W = rows.shape[1]
        _add_bias_kernel[(rows.shape[0], triton.cdiv(W, _BLOCK))](rows, bias, expert, out, W, BLOCK=_BLOCK)
        return out

    @staticmethod
    def backward(ctx, dout):
        offsets, expert = ctx.saved_tensors
        dbias = None
        if ctx.needs_input_grad[1]:
            E, W = offsets.shape[0], dout.shape[1]
            if not use_triton(dout) or dout.shape[0] == 0:
                dbias = segment_sum_reference(dout, offsets, E, expert)
            else:
                dbias = torch.empty(E, W, dtype=torch.float32, device=dout.device)
                _segment_sum_kernel[(E, triton.cdiv(W, 128))](dout.contiguous(), offsets, dbias, W, BLOCK=128, ROWS=32)
            dbias = dbias.to(ctx.bias_dtype)
        return dout, dbias, None


def add_expert_bias(rows: torch.Tensor, bias: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """rows [N, W] sorted by expert (cumulative counts `offsets` [E], int32) + bias [E, W] per row's expert."""
    return _ExpertBias.apply(rows, bias, offsets)
