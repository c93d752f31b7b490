"""The LM head fused with the cross-entropy, in chunks of tokens: the full [tokens, vocab] logits
(8192 x 151,936 fp32 = 5 GB for a Qwen3 micro-batch, and as much again for their gradient) are
never materialised.

Per chunk of rows: logits = h W^T in the compute dtype; then in fp32 the log-sum-exp and the loss
terms lse - logit[label] (`ce_forward`), and the gradient of the logits, (softmax - onehot(label))
times the incoming gradient (zero on ignored rows), written over the logits (`ce_backward`), which
gives dh = g W and dW = g^T h. Each of the head's three matmuls runs once; none is recomputed.
- One chunk (the rows fit in `CHUNK`, 8192 rows: 2.5 GB of bf16 logits for Qwen3's vocabulary):
  the forward keeps the logits and their log-sum-exps, and the backward makes the gradient with
  the incoming scale folded into the same pass, then dh and dW (dW one GEMM written in the
  weight's dtype).
- Several chunks: a chunk's logits cannot outlive it, so its gradient and dh, dW are made in the
  forward (dW accumulated in an fp32 buffer by the GEMMs, `addmm`); the backward scales them by
  the incoming gradient (`scaled`).
Peak extra memory is one chunk of logits (`chunk` rows x vocab) instead of all of them.

On CUDA the two passes are Triton kernels over the logits as the matmul wrote them (bf16 under
autocast): per row, one pass for the log-sum-exp (online max and sum, in fp32) and one that reads
the logits and writes their gradient. Eager PyTorch needs an fp32 copy, logsumexp (max, subtract,
exp, sum, log), exp, subtract, the one-hot update and the mask, each a full pass over 2048 x
151,936 values: measured ~25 ms per Qwen3 micro-batch against ~2 ms for the kernels' three passes
of bf16 (H200: 0.70 ms for the log-sum-exp pass, 1.3 ms for the gradient pass). Folding the scale
into the gradient pass removed a 0.3 ms pass over Qwen3's dW (and a small one over dh). The twins
are `ce_forward_reference` / `ce_backward_reference`; the torch twin of the whole op is
`linear_cross_entropy_reference` (F.linear then F.cross_entropy). A label outside the vocabulary
(neither in [0, V) nor the ignore index) gives its row a NaN loss, which the step guard reports,
rather than a read outside the row.
"""

import torch
import torch.nn.functional as F

from pithtrain.ops import triton, use_triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _row_loss(base, labels_ptr, loss_ptr, row, V, ignore_index, BLOCK: tl.constexpr):
        """Store row `row`'s loss (logits at `base`); return its log-sum-exp."""
        # Per-lane running max and sum; lanes that only saw padding (-1e30) vanish in the final merge.
        # One exp per value: a new max rescales the old sum by exp(m - x) and adds 1, any other
        # value adds exp(x - m); both are exp(-|x - m|).
        m = tl.full([BLOCK], -1e30, tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(base + cols, mask=cols < V, other=-1e30).to(tl.float32)
            e = tl.exp(-tl.abs(x - m))
            s = tl.where(x > m, s * e + 1.0, s + e)
            m = tl.maximum(m, x)
        big = tl.max(m, 0)
        lse = big + tl.log(tl.sum(s * tl.exp(m - big), 0))
        label = tl.load(labels_ptr + row)
        valid = label != ignore_index
        inside = (label >= 0) & (label < V)  # a label outside the vocabulary: NaN loss, no stray read
        picked = tl.load(base + tl.where(valid & inside, label, 0)).to(tl.float32)
        tl.store(loss_ptr + row, tl.where(valid, tl.where(inside, lse - picked, float("nan")), 0.0))
        return lse

    @triton.jit
    def _row_gradient(base, labels_ptr, row, lse, scale, V, ignore_index, BLOCK: tl.constexpr):
        """Write (softmax - onehot(label)) * scale (0 on an ignored row) over row `row`'s logits."""
        label = tl.load(labels_ptr + row)
        valid = label != ignore_index
        target = tl.where(valid, label, 0)
        factor = tl.where(valid, scale, 0.0)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(base + cols, mask=cols < V, other=0.0).to(tl.float32)
            g = (tl.exp(x - lse) - tl.where(cols == target, 1.0, 0.0)) * factor
            tl.store(base + cols, g.to(base.dtype.element_ty), mask=cols < V)

    @triton.jit
    def _ce_forward_kernel(logits_ptr, labels_ptr, loss_ptr, lse_ptr, V, ignore_index, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        lse = _row_loss(logits_ptr + row.to(tl.int64) * V, labels_ptr, loss_ptr, row, V, ignore_index, BLOCK)
        tl.store(lse_ptr + row, lse)

    @triton.jit
    def _ce_backward_kernel(logits_ptr, labels_ptr, lse_ptr, scale_ptr, V, ignore_index, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        _row_gradient(logits_ptr + row.to(tl.int64) * V, labels_ptr, row, tl.load(lse_ptr + row),
                      tl.load(scale_ptr).to(tl.float32), V, ignore_index, BLOCK)

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


def ce_forward_reference(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int):
    """Row losses (fp32, 0 where ignored, NaN where the label is outside the vocabulary, so the
    step guard halts) and row log-sum-exps (fp32). The twin of `ce_forward`."""
    logits32 = logits.float()
    valid = labels != ignore_index
    inside = (labels >= 0) & (labels < logits.shape[1])
    lse = torch.logsumexp(logits32, dim=-1)
    picked = logits32.gather(1, torch.where(valid & inside, labels, 0)[:, None]).squeeze(1)
    return torch.where(valid, torch.where(inside, lse - picked, float("nan")), 0.0), lse


def ce_backward_reference(logits: torch.Tensor, lse: torch.Tensor, labels: torch.Tensor, ignore_index: int,
                          scale: torch.Tensor) -> torch.Tensor:
    """(softmax - onehot(label)) * scale (0 on ignored rows) in the logits' dtype, from the row
    log-sum-exps; `scale` a 0-dim tensor. The twin of `ce_backward`."""
    valid = labels != ignore_index
    inside = (labels >= 0) & (labels < logits.shape[1])
    g = (logits.float() - lse[:, None]).exp_()
    g[torch.arange(g.shape[0], device=g.device), torch.where(valid & inside, labels, 0)] -= (valid & inside).float()
    return g.mul_((valid * scale.float())[:, None]).to(logits.dtype)


def ce_forward(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int):
    """`ce_forward_reference` in one pass over a contiguous [n, V] `logits`."""
    if not use_triton(logits) or logits.shape[0] == 0:
        return ce_forward_reference(logits, labels, ignore_index)
    loss, lse = (torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device) for _ in range(2))
    _ce_forward_kernel[(logits.shape[0],)](logits.contiguous(), labels.contiguous(), loss, lse, logits.shape[1], ignore_index,
                                           BLOCK=2048, num_warps=8)
    return loss, lse


def ce_backward(logits: torch.Tensor, lse: torch.Tensor, labels: torch.Tensor, ignore_index: int,
                scale: torch.Tensor) -> torch.Tensor:
    """`ce_backward_reference` in one pass, written over `logits` (a contiguous [n, V] buffer)."""
    if not use_triton(logits) or logits.shape[0] == 0 or not logits.is_contiguous():
        return ce_backward_reference(logits, lse, labels, ignore_index, scale)
    _ce_backward_kernel[(logits.shape[0],)](logits, labels.contiguous(), lse, scale, logits.shape[1], ignore_index,
                                            BLOCK=2048, num_warps=8)
    torch.autograd.graph.increment_version(logits)  # a saved tensor was overwritten: a second backward refuses
    return logits


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, labels, chunk, ignore_index, dtype):
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        w = weight.to(dtype)
        ctx.single, ctx.ignore_index, ctx.weight_dtype = h.shape[0] <= chunk, ignore_index, weight.dtype
        if ctx.single:  # the gradient pass waits for backward, which brings the scale
            hc = h.to(dtype)
            logits = hc @ w.T
            row_loss, lse = ce_forward(logits, labels, ignore_index)
            if want_h or want_w:
                ctx.save_for_backward(logits, lse, labels, hc, w)
                ctx.h_dtype = h.dtype
            return row_loss.sum()
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(h) if want_h else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if want_w else None
        one = torch.ones((), device=h.device)
        for start in range(0, h.shape[0], chunk):
            hc, lc = h[start:start + chunk].to(dtype), labels[start:start + chunk]
            logits = hc @ w.T
            row_loss, lse = ce_forward(logits, lc, ignore_index)
            loss += row_loss.sum()
            if not (want_h or want_w):
                continue
            g = ce_backward(logits, lse, lc, ignore_index, one)
            if want_h:
                grad_h[start:start + chunk] = (g @ w).to(h.dtype)
            if want_w and g.is_cuda and dtype != torch.float32:  # accumulate in the GEMM, fp32, no bf16 partial
                grad_w = torch.addmm(grad_w, g.T, hc, out_dtype=torch.float32)
            elif want_w:
                grad_w += (g.T @ hc).float()
        ctx.save_for_backward(grad_h, grad_w)
        return loss

    @staticmethod
    def backward(ctx, grad):
        if not ctx.single:
            grad_h, grad_w = ctx.saved_tensors
            gh = scaled(grad_h, grad, grad_h.dtype) if grad_h is not None else None
            gw = scaled(grad_w, grad, ctx.weight_dtype) if grad_w is not None else None
            return gh, gw, None, None, None, None
        logits, lse, labels, hc, w = ctx.saved_tensors
        g = ce_backward(logits, lse, labels, ctx.ignore_index, grad)
        gh = (g @ w).to(ctx.h_dtype) if ctx.needs_input_grad[0] else None
        gw = None
        if ctx.needs_input_grad[1] and g.is_cuda and g.dtype != ctx.weight_dtype:  # fp32 accumulation either way
            gw = torch.mm(g.T, hc, out_dtype=ctx.weight_dtype)
        elif ctx.needs_input_grad[1]:
            gw = (g.T @ hc).to(ctx.weight_dtype)
        return gh, gw, None, None, None, None


CHUNK = 8192  # rows per chunk: a Qwen3 micro-batch of 2 x 4096 in one (2.5 GB of bf16 logits)


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int | None = None,
                         ignore_index: int = -100) -> torch.Tensor:
    """Summed cross-entropy of logits h [N, H] @ weight [V, H]^T against labels [N] (ignore_index
    rows count zero), in fp32, without the [N, V] logits; `chunk` rows at a time (default `CHUNK`).
    Labels must lie in [0, V) or equal ignore_index: the kernels do not check the range (the training
    loop checks the corpus's vocabulary against the model's before it starts)."""
    if labels.shape != (h.shape[0],):
        raise ValueError(f"labels of shape {list(labels.shape)} for {h.shape[0]} rows of h: give one label per row")
    if not torch.is_grad_enabled():  # forward's needs_input_grad ignores no_grad: no gradients made (evaluation)
        h, weight = h.detach(), weight.detach()
    return _LinearCrossEntropy.apply(h, weight, labels.contiguous(), chunk or CHUNK, ignore_index, _compute_dtype(h))


def linear_cross_entropy_reference(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                   ignore_index: int = -100) -> torch.Tensor:
    """The torch twin: the full logits, then F.cross_entropy (sum)."""
    return F.cross_entropy(F.linear(h, weight).float(), labels, ignore_index=ignore_index, reduction="sum")
