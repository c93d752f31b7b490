"""The LM head fused with the cross-entropy, in chunks of tokens: the full [tokens, vocab] logits
(8192 x 151,936 fp32 = 5 GB for a Qwen3 micro-batch, and as much again for their gradient) are
never materialised.

For each chunk of rows: logits = h W^T in the compute dtype, then in fp32 the log-sum-exp, the
loss terms lse - logit[label], and at once the gradient of the logits, softmax - onehot(label)
(zero for ignored rows), which gives this chunk's dh = g W and adds g^T h to dW. The gradients are
made in the forward, while the chunk's logits exist, and kept for the backward, which only scales
them by the incoming gradient: the head's three matmuls are done once each, with no recomputation.
Peak extra memory is one chunk of logits (`chunk` rows x vocab) instead of all of them. When the
rows fit in one chunk (`CHUNK`, 8192 rows: 2.5 GB of bf16 logits for Qwen3's vocabulary), dW is one
GEMM written in the weight's dtype; with several, it is accumulated in an fp32 buffer by the GEMMs
(`addmm`), which reads and writes that buffer once per chunk (1.2 GB each for Qwen3's head).

On CUDA one Triton kernel (`ce_rows`) does a chunk's softmax work on the logits as the matmul
wrote them (bf16 under autocast): per row, one pass for the log-sum-exp (online max and sum, in
fp32) and one that overwrites the logits with their gradient, also giving the row's loss. Eager
PyTorch needs an fp32 copy, logsumexp (max, subtract, exp, sum, log), exp, subtract, the one-hot
update and the mask, each a full pass over 2048 x 151,936 values: measured ~25 ms per Qwen3
micro-batch against ~2 ms for the kernel's three passes of bf16. `ce_rows_reference` is its twin;
the torch twin of the whole op is `linear_cross_entropy_reference` (F.linear then F.cross_entropy).
"""

import torch
import torch.nn.functional as F

from pithtrain.ops import triton, use_triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _ce_rows_kernel(logits_ptr, labels_ptr, loss_ptr, V, ignore_index, WANT_GRAD: tl.constexpr,
                        BLOCK: tl.constexpr):
        row = tl.program_id(0)
        base = logits_ptr + row.to(tl.int64) * V
        # Per-lane running max and sum; lanes that only saw padding (-1e30) vanish in the final merge.
        m = tl.full([BLOCK], -1e30, tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(base + cols, mask=cols < V, other=-1e30).to(tl.float32)
            m_new = tl.maximum(m, x)
            s = s * tl.exp(m - m_new) + tl.exp(x - m_new)
            m = m_new
        big = tl.max(m, 0)
        lse = big + tl.log(tl.sum(s * tl.exp(m - big), 0))
        label = tl.load(labels_ptr + row)
        valid = label != ignore_index
        target = tl.where(valid, label, 0)
        picked = tl.load(base + target).to(tl.float32)
        tl.store(loss_ptr + row, tl.where(valid, lse - picked, 0.0))
        if WANT_GRAD:
            keep = tl.where(valid, 1.0, 0.0)
            for start in range(0, V, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                x = tl.load(base + cols, mask=cols < V, other=0.0).to(tl.float32)
                g = (tl.exp(x - lse) - tl.where(cols == target, 1.0, 0.0)) * keep
                tl.store(base + cols, g.to(logits_ptr.dtype.element_ty), mask=cols < V)


    @triton.jit
    def _scale_kernel(x_ptr, s_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        s = tl.load(s_ptr).to(tl.float32)
        x = tl.load(x_ptr + offs, mask=offs < n).to(tl.float32)
        tl.store(out_ptr + offs, (x * s).to(out_ptr.dtype.element_ty), mask=offs < n)


def scaled_reference(x: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x * s in fp32 (s a 0-dim tensor), as `dtype`: the twin of `scaled`."""
    return (x.float() * s.float()).to(dtype)


def scaled(x: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`scaled_reference` in one pass. PyTorch's bf16 tensor times an fp32 0-dim CUDA tensor takes
    its unvectorised mixed-dtype path: 1.2 ms for the head's 0.6 GB gradient against 0.3 ms here."""
    if not use_triton(x, ndim=None) or not x.is_contiguous() or x.numel() == 0:
        return scaled_reference(x, s, dtype)
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    _scale_kernel[(triton.cdiv(x.numel(), 4096),)](x, s, out, x.numel(), BLOCK=4096, num_warps=8)
    return out


def ce_rows_reference(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, want_grad: bool):
    """Row losses (fp32, 0 where ignored) and, if `want_grad`, the logits' gradient softmax - onehot
    (0 on ignored rows) in the logits' dtype. The twin of `ce_rows`."""
    logits32 = logits.float()
    valid = labels != ignore_index
    target = torch.where(valid, labels, 0)
    lse = torch.logsumexp(logits32, dim=-1)
    loss = torch.where(valid, lse - logits32.gather(1, target[:, None]).squeeze(1), 0.0)
    if not want_grad:
        return loss, None
    g = logits32.sub_(lse[:, None]).exp_()
    g[torch.arange(g.shape[0], device=g.device), target] -= 1.0
    return loss, g.mul_(valid[:, None]).to(logits.dtype)


def ce_rows(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, want_grad: bool):
    """`ce_rows_reference`, with the gradient written over `logits` (a contiguous [n, V] buffer)."""
    if not use_triton(logits) or logits.shape[0] == 0:
        return ce_rows_reference(logits, labels, ignore_index, want_grad)
    logits = logits.contiguous()
    loss = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    _ce_rows_kernel[(logits.shape[0],)](logits, labels, loss, logits.shape[1], ignore_index, WANT_GRAD=want_grad,
                                        BLOCK=2048, num_warps=8)
    return loss, logits if want_grad else None


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, labels, chunk, ignore_index, dtype):
        want_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        w = weight.to(dtype)
        single = h.shape[0] <= chunk  # one chunk: dW in one GEMM, no fp32 accumulator
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1] and not single:
            grad_w = torch.zeros_like(weight, dtype=torch.float32)
        for start in range(0, h.shape[0], chunk):
            hc, lc = h[start:start + chunk].to(dtype), labels[start:start + chunk]
            row_loss, g = ce_rows(hc @ w.T, lc, ignore_index, want_grad)
            loss += row_loss.sum()
            if not want_grad:
                continue
            if grad_h is not None:
                grad_h[start:start + chunk] = (g @ w).to(h.dtype)
            if not ctx.needs_input_grad[1]:
                continue
            if single:  # straight to the weight's dtype (the GEMM accumulates in fp32 either way)
                if g.is_cuda and dtype != weight.dtype:
                    grad_w = torch.mm(g.T, hc, out_dtype=weight.dtype)
                else:
                    grad_w = (g.T @ hc).to(weight.dtype)
            elif g.is_cuda and dtype != torch.float32:  # accumulate in the GEMM, fp32, no bf16 partial
                grad_w = torch.addmm(grad_w, g.T, hc, out_dtype=torch.float32)
            else:
                grad_w += (g.T @ hc).float()
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad):
        grad_h, grad_w = ctx.saved_tensors
        gh = scaled(grad_h, grad, grad_h.dtype) if grad_h is not None else None
        gw = scaled(grad_w, grad, ctx.weight_dtype) if grad_w is not None else None
        return gh, gw, None, None, None, None


CHUNK = 8192  # rows per chunk: a Qwen3 micro-batch of 2 x 4096 in one (2.5 GB of bf16 logits)


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int | None = None,
                         ignore_index: int = -100) -> torch.Tensor:
    """Summed cross-entropy of logits h [N, H] @ weight [V, H]^T against labels [N] (ignore_index
    rows count zero), in fp32, without the [N, V] logits; `chunk` rows at a time (default `CHUNK`)."""
    return _LinearCrossEntropy.apply(h, weight, labels, chunk or CHUNK, ignore_index, _compute_dtype(h))


def linear_cross_entropy_reference(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                   ignore_index: int = -100) -> torch.Tensor:
    """The torch twin: the full logits, then F.cross_entropy (sum)."""
    return F.cross_entropy(F.linear(h, weight).float(), labels, ignore_index=ignore_index, reduction="sum")
