"""The LM head fused with the cross-entropy, in chunks of tokens: the full [tokens, vocab] logits
(8192 x 151,936 fp32 = 5 GB for a Qwen3 micro-batch, and as much again for their gradient) are
never materialised.

For each chunk of rows: logits = h W^T in the compute dtype, then in fp32 the log-sum-exp, the
loss terms lse - logit[label], and at once the gradient of the logits, softmax - onehot(label)
(zero for ignored rows), which gives this chunk's dh = g W and adds g^T h to dW. The gradients are
made in the forward, while the chunk's logits exist, and kept for the backward, which only scales
them by the incoming gradient: the head's three matmuls are done once each, with no recomputation.
Peak extra memory is one chunk of fp32 logits (`chunk` rows x vocab) instead of all of them.
The torch twin is `linear_cross_entropy_reference` (F.linear then F.cross_entropy).
"""

import torch
import torch.nn.functional as F


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, labels, chunk, ignore_index, dtype):
        want_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        w = weight.to(dtype)
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        for start in range(0, h.shape[0], chunk):
            hc, lc = h[start:start + chunk].to(dtype), labels[start:start + chunk]
            logits = (hc @ w.T).float()
            valid = lc != ignore_index
            target = torch.where(valid, lc, 0)
            lse = torch.logsumexp(logits, dim=-1)
            loss += torch.where(valid, lse - logits.gather(1, target[:, None]).squeeze(1), 0.0).sum()
            if not want_grad:
                continue
            g = logits.sub_(lse[:, None]).exp_()  # softmax, in place
            g[torch.arange(g.shape[0], device=g.device), target] -= 1.0
            g = g.mul_(valid[:, None]).to(dtype)
            if grad_h is not None:
                grad_h[start:start + chunk] = (g @ w).to(h.dtype)
            if grad_w is not None:
                grad_w += g.T @ hc
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad):
        grad_h, grad_w = ctx.saved_tensors
        gh = grad_h * grad.to(grad_h.dtype) if grad_h is not None else None
        gw = (grad_w * grad).to(ctx.weight_dtype) if grad_w is not None else None
        return gh, gw, None, None, None, None


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int = 2048,
                         ignore_index: int = -100) -> torch.Tensor:
    """Summed cross-entropy of logits h [N, H] @ weight [V, H]^T against labels [N] (ignore_index
    rows count zero), in fp32, without the [N, V] logits."""
    return _LinearCrossEntropy.apply(h, weight, labels, chunk, ignore_index, _compute_dtype(h))


def linear_cross_entropy_reference(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                   ignore_index: int = -100) -> torch.Tensor:
    """The torch twin: the full logits, then F.cross_entropy (sum)."""
    return F.cross_entropy(F.linear(h, weight).float(), labels, ignore_index=ignore_index, reduction="sum")
