"""Fused ops: Triton kernels on CUDA (and on CPU under TRITON_INTERPRET=1, for tests), their
torch twins elsewhere. Each op's module says what its kernel fuses and why that is faster."""

import os

import torch

try:
    import triton
except ImportError:  # CPU-only installs: the torch twins run
    triton = None


KERNELS = os.environ.get("PITHTRAIN_KERNELS", "1") != "0"  # 0: the torch twins everywhere (for comparisons)


def use_triton(x: torch.Tensor, ndim: int | None = 2) -> bool:
    """Whether the Triton kernels run for `x` (of `ndim` dimensions, None: any; on CUDA, or anywhere
    when interpreting)."""
    return (KERNELS and triton is not None and (ndim is None or x.dim() == ndim)
            and (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"))
