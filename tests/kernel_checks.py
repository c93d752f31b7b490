"""Kernel-vs-twin checks shared by the CPU interpreter test (tests/test_ops.py runs this file with
TRITON_INTERPRET=1) and the GPU tests (tests/test_gpu.py calls `run_all("cuda")`)."""

import sys

import torch

from pithtrain.ops import permute as pm
from pithtrain.ops import swiglu as sw


def _compare(fn, ref, x, tol):
    x1 = x.clone().requires_grad_()
    x2 = x.clone().float().requires_grad_()
    out, want = fn(x1), ref(x2)
    g = torch.randn_like(want)
    out.backward(g.to(out.dtype))
    want.backward(g)
    err = ((out.float() - want).norm() / want.norm().clamp(min=1e-30)).item()
    gerr = ((x1.grad.float() - x2.grad).norm() / x2.grad.norm().clamp(min=1e-30)).item()
    assert err < tol and gerr < tol, (fn, x.shape, x.dtype, err, gerr)


def check_swiglu(device: str) -> None:
    assert sw.use_triton(torch.empty(1, 2, device=device)), "the Triton path is not taken"
    gen = torch.Generator(device).manual_seed(0)
    shapes = [(37, 2 * 100), (1, 2 * 3), (0, 2 * 8), (300, 2 * 1536)] if device == "cuda" else [(37, 200), (1, 6), (0, 16)]
    for dtype in ([torch.float32, torch.bfloat16] if device == "cuda" else [torch.float32]):
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        for rows, cols in shapes:
            x = (torch.randn(rows, cols, device=device, generator=gen) * 3).to(dtype)
            _compare(sw.swiglu, sw.swiglu_reference, x, tol)
            _compare(lambda t: sw.clamped_swiglu(t, 1.702, 2.0),
                     lambda t: sw.clamped_swiglu_reference(t, 1.702, 2.0), x, tol)
    x = torch.tensor([[2.0, 2.0, -2.0, -2.0, 2.5, 3.0]], device=device)  # clamps at and past the limits
    _compare(lambda t: sw.clamped_swiglu(t, 1.702, 2.0), lambda t: sw.clamped_swiglu_reference(t, 1.702, 2.0), x, 1e-6)


def check_permute(device: str) -> None:
    """permute / combine (Triton) against the twins, with all pairs kept and with missing pairs."""
    gen = torch.Generator(device).manual_seed(1)
    cases = [(9, 3, 40, 0), (9, 3, 40, 5), (1, 2, 7, 1)] + ([(2048, 8, 2048, 300)] if device == "cuda" else [])
    for N, k, H, drop in cases:
        order = torch.randperm(N * k, device=device, generator=gen)[: N * k - drop]
        M = order.shape[0]
        pos = torch.full((N * k,), M, dtype=torch.long, device=device)
        pos[order] = torch.arange(M, device=device)
        for dtype in ([torch.float32, torch.bfloat16] if device == "cuda" else [torch.float32]):
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            x = torch.randn(N, H, device=device, generator=gen).to(dtype)
            rows = torch.randn(M, H, device=device, generator=gen).to(dtype)
            w = torch.rand(N, k, device=device, generator=gen)
            dout = torch.randn(N, H, device=device, generator=gen).to(dtype)
            pairs = [(pm.gather_rows(x, order, k), pm.gather_rows_reference(x, order, k)),
                     (pm.gather_rows(x, order, k, w.flatten()[order]),
                      pm.gather_rows_reference(x, order, k, w.flatten()[order])),
                     (pm.sum_slots(rows, pos, k), pm.sum_slots_reference(rows, pos, k)),
                     (pm.sum_slots(rows, pos, k, w), pm.sum_slots_reference(rows.float(), pos, k, w)),
                     (pm.slot_dots(rows, dout, pos, k), pm.slot_dots_reference(rows, dout, pos, k))]
            for got, want in pairs:
                err = ((got.float() - want.float()).norm() / want.float().norm().clamp(min=1e-30)).item()
                assert err < tol, (N, k, H, drop, dtype, err)


def run_all(device: str) -> None:
    check_swiglu(device)
    check_permute(device)


if __name__ == "__main__":
    run_all(sys.argv[1] if len(sys.argv) > 1 else "cpu")
    print("kernel checks passed")
