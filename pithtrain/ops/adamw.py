"""The AdamW update of one parameter as one Triton kernel.

torch.optim.AdamW's update (decoupled weight decay, bias-corrected moments, the same formula as
torch's fused kernel) reads the weight, its gradient and the two moments and writes the weight
and the moments back: 14 bytes per element in bf16, 28 in fp32, and nothing to compute. It is
memory-bound, so its time is its bandwidth: torch's multi-tensor `_fused_adamw_` reaches ~58% of
the copy ceiling on the H200 (18 ms for 3.1 B bf16 parameters); this kernel streams each
parameter once in wide blocks, with the bias corrections computed on the device from the step
count (no host synchronisation, no step-dependent recompilation). Gradient clipping's factor
(`grad_scale`, a 0-d device tensor) is applied as the gradient is read, which saves clipping's own
pass over every gradient (a read and a write: 4 of the 14 bytes per element again). `adamw_reference`
is its torch twin. The optimizer that calls it is `AdamW` in `train/optim.py`.

Clipping still needs the gradients' global norm before the update, one read of every gradient (2
bytes per element in bf16). `squares_sum` makes it at the copy ceiling's read rate: one kernel
per gradient, each program summing the squares of one block in fp32 into its own slot of one
buffer, then one sum over the slots (the same order every run: deterministic). torch's
`_foreach_norm` read them at 68% of the ceiling, this kernel at 99% (Qwen3 proxy, H100). Its twin is
`squares_sum_reference`.
"""

import math

import torch

from pithtrain.ops import triton, use_triton

if triton is not None:
    import triton.language as tl

BLOCK, WARPS = 2048, 4  # measured best of 8 tiles on the H200 (benchmarks/kernels.py --sweep)
SQ_BLOCK, SQ_WARPS = 8192, 8  # squares_sum's tile


def adamw_reference(p, g, m, v, step, lr, beta1, beta2, eps, weight_decay, grad_scale=None) -> None:
    """In place, in fp32, stored back in each tensor's dtype; `step` (a 0-d tensor) already counts
    this update; the gradient is `g` times `grad_scale` (a 0-d tensor) if given."""
    t = step.float()
    pf, gf, mf, vf = p.float(), g.float(), m.float(), v.float()
    if grad_scale is not None:
        gf = gf * grad_scale.float()
    mf = mf + (1 - beta1) * (gf - mf)
    vf = beta2 * vf + (1 - beta2) * gf * gf
    bc1, bc2 = 1 - beta1 ** t, 1 - beta2 ** t
    pf = pf * (1 - lr * weight_decay) - (lr / bc1) * mf / (vf.sqrt() / bc2.sqrt() + eps)
    p.copy_(pf), m.copy_(mf), v.copy_(vf)


if triton is not None:

    @triton.jit
    def _adamw(p_ptr, g_ptr, m_ptr, v_ptr, step_ptr, scale_ptr, n, lr, lr_ptr, beta1, beta2, eps, decay, log_beta1,
               log_beta2, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        if lr_ptr is not None:
            lr = tl.load(lr_ptr).to(tl.float32)
        t = tl.load(step_ptr).to(tl.float32)
        bc1 = 1.0 - tl.exp(t * log_beta1)
        bc2 = 1.0 - tl.exp(t * log_beta2)
        p = tl.load(p_ptr + offs, mask=mask).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
        if scale_ptr is not None:
            g = g * tl.load(scale_ptr).to(tl.float32)
        m = tl.load(m_ptr + offs, mask=mask).to(tl.float32)
        v = tl.load(v_ptr + offs, mask=mask).to(tl.float32)
        m = m + (1.0 - beta1) * (g - m)
        v = beta2 * v + (1.0 - beta2) * g * g
        p = p * (1.0 - lr * decay) - (lr / bc1) * m / (tl.sqrt(v) / tl.sqrt(bc2) + eps)
        tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=mask)
        tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=mask)
        tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty), mask=mask)


def _log(beta: float) -> float:
    return math.log(beta) if beta > 0 else float("-inf")  # beta 0: no bias correction


def adamw_update(p, g, m, v, step, lr, beta1, beta2, eps, weight_decay, grad_scale=None) -> None:
    """`adamw_reference` as one kernel launch (contiguous tensors of one shape), the twin otherwise.
    `lr` is a float, or a 0-d device tensor read by the kernel (a CUDA graph of the update then
    follows the schedule: `train/graphs.py`)."""
    tensors = (p, g, m, v)
    if not (use_triton(p, ndim=None) and all(t.is_contiguous() and t.shape == p.shape for t in tensors)):
        return adamw_reference(p, g, m, v, step, lr, beta1, beta2, eps, weight_decay, grad_scale)
    n = p.numel()
    if n:
        on_device = isinstance(lr, torch.Tensor)
        _adamw[(triton.cdiv(n, BLOCK),)](p, g, m, v, step, grad_scale, n, 0.0 if on_device else lr,
                                         lr if on_device else None, beta1, beta2, eps, weight_decay,
                                         _log(beta1), _log(beta2), BLOCK=BLOCK, num_warps=WARPS)


if triton is not None:

    @triton.jit
    def _squares(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
        tl.store(out_ptr + tl.program_id(0), tl.sum(x * x, 0))


def squares_sum_reference(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Sum of the squares of every element of `tensors` (non-empty list), as a 0-d fp32 tensor (no
    fp32 copy of them): torch's per-tensor norms, squared and summed. The twin of `squares_sum`.
    Off CUDA the norms are taken in fp64: torch's fp32 norm on the CPU is off by ~1e-5 relative on
    a tensor of half a million elements, which made the logged norm differ by that much between
    layouts whose shards it sums separately."""
    dtype = torch.float32 if tensors[0].is_cuda else torch.float64
    return torch.stack(torch._foreach_norm(tensors, 2, dtype=dtype)).square().sum().float()


def squares_sum(tensors: list[torch.Tensor]) -> torch.Tensor:
    """`squares_sum_reference` as a 0-d fp32 tensor on the tensors' device: the kernel over each
    contiguous tensor, the twin over any others (and everywhere off CUDA). `tensors` must not be
    empty (its device is the result's)."""
    if not tensors:
        raise ValueError("squares_sum of no tensors: there is no device to put the sum on")
    kernel = [use_triton(t, ndim=None) and t.is_contiguous() for t in tensors]
    fast = [t for t, k in zip(tensors, kernel) if k and t.numel()]
    rest = [t for t, k in zip(tensors, kernel) if not k]
    total = squares_sum_reference(rest) if rest else None
    if fast:
        grids = [triton.cdiv(t.numel(), SQ_BLOCK) for t in fast]
        slots = torch.empty(sum(grids), dtype=torch.float32, device=fast[0].device)
        start = 0
        for t, grid in zip(fast, grids):
            _squares[(grid,)](t, slots[start:start + grid], t.numel(), BLOCK=SQ_BLOCK, num_warps=SQ_WARPS)
            start += grid
        total = slots.sum() if total is None else total + slots.sum()
    return total if total is not None else torch.zeros((), dtype=torch.float32, device=tensors[0].device)
