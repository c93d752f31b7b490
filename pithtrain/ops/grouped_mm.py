"""Grouped GEMM over experts: rows sorted by expert, one weight matrix per expert.

On CUDA this is `torch._grouped_mm` (one kernel for all experts, offsets stay on the device, so
there is no host synchronisation). Its torch twin, a loop of plain matmuls, runs on CPU: it is the
reference in tests, and it handles experts that receive no rows, which the CPU `_grouped_mm`
backward does not.
"""

import torch


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x [N, K] (rows of expert g are x[offsets[g-1]:offsets[g]]), w [G, K, M] -> [N, M].

    `offsets` holds the cumulative row counts, int32, one per expert.
    """
    if x.is_cuda:
        dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x.dtype
        return torch._grouped_mm(x.to(dtype), w.to(dtype), offs=offsets)
    return grouped_mm_reference(x, w, offsets)


def grouped_mm_reference(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The plain-PyTorch twin of `grouped_mm`."""
    out, start = [], 0
    for g, end in enumerate(offsets.tolist()):
        out.append(x[start:end] @ w[g].to(x.dtype))
        start = end
    return torch.cat(out) if out else x.new_zeros(0, w.shape[-1])
