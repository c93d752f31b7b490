"""Fused ops against their torch twins (CPU here; tests/test_gpu.py repeats them on CUDA)."""

import os

import pytest
import torch

from pithtrain.ops.cross_entropy import linear_cross_entropy, linear_cross_entropy_reference


@pytest.mark.parametrize("n,chunk", [(37, 8), (64, 64), (5, 16), (100, 33)])
def test_linear_cross_entropy_matches_twin(n, chunk):
    gen = torch.Generator().manual_seed(n)
    h = torch.randn(n, 24, generator=gen, requires_grad=True)
    w = (torch.randn(211, 24, generator=gen) * 0.3).requires_grad_()
    labels = torch.randint(0, 211, (n,), generator=gen)
    labels[::4] = -100  # ignored rows: no loss, no gradient
    got = linear_cross_entropy(h, w, labels, chunk=chunk)
    want = linear_cross_entropy_reference(h, w, labels)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    scale = 0.37  # the incoming gradient scales the precomputed ones
    gh, gw = torch.autograd.grad(got * scale, [h, w])
    rh, rw = torch.autograd.grad(want * scale, [h, w])
    torch.testing.assert_close(gh, rh, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw, rw, rtol=1e-5, atol=1e-6)
    assert gh[::4].abs().max() == 0


def test_linear_cross_entropy_without_grad_and_all_ignored():
    h, w = torch.randn(10, 8), torch.randn(30, 8)
    labels = torch.randint(0, 30, (10,))
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(h, w, labels, chunk=3),
                                   linear_cross_entropy_reference(h, w, labels))
    h.requires_grad_()
    loss = linear_cross_entropy(h, w, torch.full((10,), -100), chunk=4)
    loss.backward()
    assert loss.item() == 0 and h.grad.abs().max() == 0


def test_bad_shapes_are_refused():
    from pithtrain.ops.swiglu import clamped_swiglu, swiglu

    h, w = torch.randn(6, 8), torch.randn(30, 8)
    with pytest.raises(ValueError, match="one label per row"):
        linear_cross_entropy(h, w, torch.zeros(5, dtype=torch.long))
    torch.testing.assert_close(linear_cross_entropy(h, w, torch.arange(12)[::2]),  # a strided view is fine
                               linear_cross_entropy_reference(h, w, torch.arange(12)[::2]))
    for f in (swiglu, lambda x: clamped_swiglu(x, 1.702, 7.0)):
        with pytest.raises(ValueError, match="pairs"):
            f(torch.randn(3, 7))


def test_triton_kernels_match_twins_in_the_interpreter(tmp_path):
    """Every Triton kernel against its torch twin on CPU, run by the Triton interpreter; then each
    launch that ran (its argument types and constexprs) compiled for Hopper (sm_90) by Triton's
    compiler, which refuses code the interpreter runs."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": root, "OMP_NUM_THREADS": "1"}
    out = str(tmp_path / "signatures.json")
    proc = subprocess.run([sys.executable, os.path.join(root, "tests", "kernel_checks.py"), "cpu", out],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0 and "kernel checks passed" in proc.stdout, proc.stdout + proc.stderr[-4000:]
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("this process interprets Triton: nothing to compile")
    sys.path.insert(0, os.path.join(root, "tests"))
    import kernel_checks

    with open(out) as f:
        record = json.load(f)
    compiled = kernel_checks.compile_for(record["signatures"])
    assert len(record["launched"]) >= 10 and sorted(set(compiled)) == record["launched"], (compiled, record["launched"])


def test_activation_twins_on_cpu():
    """The CPU path is the twin (no Triton outside CUDA unless interpreting)."""
    from pithtrain.ops import swiglu as sw

    x = torch.randn(5, 8)
    torch.testing.assert_close(sw.swiglu(x), torch.nn.functional.silu(x[:, :4]) * x[:, 4:])
    assert not sw.use_triton(x) or os.environ.get("TRITON_INTERPRET") == "1"


def test_the_head_makes_no_gradient_under_no_grad(monkeypatch):
    """Evaluation (no_grad) with parameters that require grad: the chunked path makes no gradient
    (forward's needs_input_grad alone would say it is wanted), and the loss is the same."""
    from pithtrain.ops import cross_entropy as ce

    h, w = torch.randn(40, 8, requires_grad=True), torch.randn(30, 8, requires_grad=True)
    labels = torch.randint(0, 30, (40,))
    calls = []
    monkeypatch.setattr(ce, "ce_backward", lambda *a: calls.append(1) or ce.ce_backward_reference(*a))
    with torch.no_grad():
        loss = linear_cross_entropy(h, w, labels, chunk=8)
    assert not calls and not loss.requires_grad
    torch.testing.assert_close(loss, linear_cross_entropy_reference(h, w, labels).detach())
    linear_cross_entropy(h, w, labels, chunk=8).backward()
    assert len(calls) == 5 and h.grad is not None



def test_squares_sum_off_cuda_is_exact_to_fp32():
    """Clipping's sum of squares on the CPU: torch's fp32 norm of half a million elements is off by
    ~1e-5 relative, which made one layout's logged norm differ from another's (shards summed apart)."""
    from pithtrain.ops.adamw import squares_sum

    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(4096, 128, generator=g) * 1e-3, torch.randn(300, generator=g).bfloat16()]
    want = sum(t.double().square().sum() for t in ts)
    got = squares_sum(ts)
    assert got.dtype == torch.float32 and abs(got.double() - want) <= 1e-7 * want
    halves = squares_sum([ts[0][:2048]]) + squares_sum([ts[0][2048:], ts[1]])  # as two shards would
    assert abs(halves.double() - want) <= 1e-7 * want
