"""Kernel-vs-twin checks shared by the CPU interpreter test (tests/test_ops.py runs this file with
TRITON_INTERPRET=1) and the GPU tests (tests/test_gpu.py calls `run_all("cuda")`)."""

import collections
import contextlib
import sys

import pytest
import torch

from pithtrain.ops import adamw as aw
from pithtrain.ops import use_triton
from pithtrain.ops import cross_entropy as ce
from pithtrain.ops import embedding as em
from pithtrain.ops import expert_bias as eb
from pithtrain.ops import permute as pm
from pithtrain.ops import swiglu as sw


LAUNCHED: collections.Counter = collections.Counter()  # Triton kernel launches by kernel name
SIGNATURES: set = set()  # (module, kernel, argument types, constexprs, num_warps) of every launch
DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "i64",
          torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1"}


def _signature(fn, args, kwargs) -> tuple:
    """A launch's argument types as Triton's compiler names them, its constexprs and warps."""
    import inspect

    params = inspect.signature(fn).parameters
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "grid", "warmup") if k in kwargs}
    bound = inspect.Signature(list(params.values())).bind(*args, **kwargs).arguments
    types, consts = [], []
    for name, value in bound.items():
        if "constexpr" in str(params[name].annotation) or value is None:  # None: a constexpr to Triton
            consts.append((name, value))
        elif isinstance(value, torch.Tensor):
            types.append((name, "*" + DTYPES[value.dtype]))
        elif isinstance(value, bool):
            types.append((name, "i1"))
        elif isinstance(value, int):
            types.append((name, "i32" if -2**31 <= value < 2**31 else "i64"))
        elif isinstance(value, float):
            types.append((name, "fp32"))
        else:
            raise TypeError(f"{fn.__name__}: argument {name} of type {type(value).__name__} not recorded")
    return fn.__module__, fn.__name__, tuple(types), tuple(consts), options.get("num_warps", 4)


@contextlib.contextmanager
def counting_launches():
    """Count every Triton kernel launch (compiled or interpreted) by name while it is open."""
    import triton.runtime.jit as jit

    classes = [jit.JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction

        classes.append(InterpretedFunction)
    except ImportError:
        pass
    originals = {cls: cls.__dict__.get("run") for cls in classes}  # None: inherited

    def counting(run):
        def counted(self, *args, **kwargs):
            if not kwargs.get("warmup"):
                LAUNCHED[self.fn.__name__] += 1
                SIGNATURES.add(_signature(self.fn, args, dict(kwargs)))
            return run(self, *args, **kwargs)
        return counted

    for cls in classes:
        cls.run = counting(cls.run)
    try:
        yield
    finally:
        for cls, run in originals.items():
            if run is None:
                del cls.run
            else:
                cls.run = run


@contextlib.contextmanager
def kernels_run(*names: str):
    """The block must launch each of these Triton kernels: an op that fell back to its torch twin
    would compare the twin with itself."""
    before = {n: LAUNCHED[n] for n in names}
    yield
    missing = [n for n in names if LAUNCHED[n] == before[n]]
    assert not missing, f"Triton kernels {missing} never ran: the ops took their torch twins"


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
    tiles = [dict(sw.TILE), {"rows": 4, "block": 64, "warps": 2}]  # the tuned tile and a ragged small one
    for tile, dtype in [(t, d) for t in tiles for d in ([torch.float32, torch.bfloat16] if device == "cuda" else [torch.float32])]:
        sw.TILE.update(tile)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        for rows, cols in shapes:
            x = (torch.randn(rows, cols, device=device, generator=gen) * 3).to(dtype)
            _compare(sw.swiglu, sw.swiglu_reference, x, tol)
            _compare(lambda t: sw.clamped_swiglu(t, 1.702, 2.0),
                     lambda t: sw.clamped_swiglu_reference(t, 1.702, 2.0), x, tol)
    sw.TILE.update(tiles[0])
    x = torch.tensor([[2.0, 2.0, -2.0, -2.0, 2.5, 3.0]], device=device)  # clamps at and past the limits
    _compare(lambda t: sw.clamped_swiglu(t, 1.702, 2.0), lambda t: sw.clamped_swiglu_reference(t, 1.702, 2.0), x, 1e-6)
    nan = float("nan")  # a NaN gate or up stays NaN through the clamp, as in the twin (the guard must see it)
    x = torch.tensor([[nan, 1.0, 0.5, nan, 0.5, 1.0]], device=device)
    got, want = sw.clamped_swiglu(x, 1.702, 2.0), sw.clamped_swiglu_reference(x, 1.702, 2.0)
    assert torch.equal(got.isnan(), want.isnan()) and want.isnan()[0, :2].all(), (got, want)
    torch.testing.assert_close(got[:, 2], want[:, 2])


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
            by_order = x.index_select(0, order // k)  # row i = token order[i] // k, written independently
            drows, dw = pm.scatter_rows(dout, pos, k, M, w, rows=rows)
            pairs = [(pm.scatter_rows(x, pos, k, M), by_order), (pm.scatter_rows_reference(x, pos, k, M), by_order),
                     (pm.scatter_rows(x, pos, k, M, w), pm.scatter_rows_reference(x, pos, k, M, w)),
                     (drows, pm.scatter_rows_reference(dout, pos, k, M, w)),
                     (dw, pm.slot_dots_reference(rows, dout, pos, k)),
                     (pm.sum_slots(rows, pos, k), pm.sum_slots_reference(rows, pos, k)),
                     (pm.sum_slots(rows, pos, k, w), pm.sum_slots_reference(rows.float(), pos, k, w))]
            for got, want in pairs:
                err = ((got.float() - want.float()).norm() / want.float().norm().clamp(min=1e-30)).item()
                assert err < tol, (N, k, H, drop, dtype, err)


def check_cross_entropy_rows(device: str) -> None:
    """ce_forward (row losses, log-sum-exps) and ce_backward (the logits' gradient times a scale,
    written over them) against their twins, with ignored rows, a vocabulary that is not a multiple
    of the block, a row whose label is the last column, and labels outside the vocabulary (NaN
    loss, no read outside the row)."""
    assert ce.use_triton(torch.empty(1, 2, device=device)), "the Triton path is not taken"
    gen = torch.Generator(device).manual_seed(2)
    cases = [(5, 5000), (3, 7), (0, 100)] + ([(64, 151936), (33, 1000)] if device == "cuda" else [])
    scale = torch.tensor(0.37, device=device)
    for n, V in cases:
        for dtype in ([torch.float32, torch.bfloat16] if device == "cuda" else [torch.float32]):
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            logits = (torch.randn(n, V, device=device, generator=gen) * 4).to(dtype)
            labels = torch.randint(0, V, (n,), device=device, generator=gen)
            if n:
                labels[0] = V - 1
                labels[n // 2] = -100
            outside = [1, n - 1] if n > 3 else []
            labels[outside] = torch.tensor([V, -3], device=device)[:len(outside)]
            want_loss, want_lse = ce.ce_forward_reference(logits, labels, -100)
            want_g = ce.ce_backward_reference(logits, want_lse, labels, -100, scale)
            loss, lse = ce.ce_forward(logits, labels, -100)
            buf = logits.clone()
            g = ce.ce_backward(buf, lse, labels, -100, scale)
            assert n == 0 or g.data_ptr() == buf.data_ptr(), "the gradient is not written over the logits"
            assert loss[outside].isnan().all() and want_loss[outside].isnan().all(), (n, V)
            keep = torch.ones(n, dtype=torch.bool, device=device)
            keep[outside] = False
            for got, want in [(loss[keep], want_loss[keep]), (lse, want_lse), (g, want_g)]:
                err = ((got.float() - want.float()).norm() / want.float().norm().clamp(min=1e-30)).item()
                assert err < tol, (n, V, dtype, err)
            if n:
                assert loss[n // 2] == 0 and g[n // 2].abs().sum() == 0
    # labels that are a strided view (every other one of a longer tensor), through the head
    h = torch.randn(12, 16, device=device, generator=gen, requires_grad=True)
    w = torch.randn(37, 16, device=device, generator=gen, requires_grad=True)
    labels = torch.randint(0, 37, (24,), device=device, generator=gen)[::2]
    for chunk in (64, 5):  # one chunk, several
        got = torch.autograd.grad(ce.linear_cross_entropy(h, w, labels, chunk=chunk) * 0.37, [h, w])
        want = torch.autograd.grad(ce.linear_cross_entropy_reference(h, w, labels) * 0.37, [h, w])
        for a, b in zip(got, want):
            assert (a - b).abs().max() < 1e-4, ("strided labels", chunk)


def check_embedding(device: str) -> None:
    """embedding_backward (Triton: per run of equal sorted ids, R rows a step) against its twin: runs
    shorter and longer than R (one id 3R + 1 times), every id the same, widths that are not a
    multiple of the block; the autograd op against F.embedding's gradient."""
    assert em.use_triton(torch.empty(1, 2, device=device)), "the Triton path is not taken"
    gen = torch.Generator(device).manual_seed(6)
    R = em.TILE["rows"]
    cases = [(50, 37, 20), (3 * R + 1, 5, 9), (1, 4, 3)] + ([(8192, 151936, 2048), (4000, 30, 1500)] if device == "cuda" else [])
    for n, V, H in cases:
        for dtype in ([torch.float32, torch.bfloat16] if device == "cuda" else [torch.float32]):
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            ids = torch.randint(0, V, (n,), device=device, generator=gen)
            ids[: min(n, 3 * R + 1)] = V - 1  # one long run, at the last row of the table
            grad = torch.randn(n, H, device=device, generator=gen).to(dtype)
            got = em.embedding_backward(grad, ids, V, dtype)
            want = em.embedding_backward_reference(grad, ids, V, dtype)
            err = ((got.float() - want.float()).norm() / want.float().norm().clamp(min=1e-30)).item()
            assert got.dtype == dtype and err < tol, (n, V, H, dtype, err)
            assert torch.equal(got, em.embedding_backward(grad, ids, V, dtype)), "not deterministic"
    w = torch.randn(11, 6, device=device, generator=gen, requires_grad=True)
    ids = torch.randint(0, 11, (3, 7), device=device, generator=gen)
    dout = torch.randn(3, 7, 6, device=device, generator=gen)
    ids[0, :3] = 4  # a padding row that the lookup uses: no gradient there, as nn.Embedding's
    for pad in (None, 4):
        got = torch.autograd.grad(em.embedding(ids, w, pad), w, dout)[0]
        want = torch.autograd.grad(torch.nn.functional.embedding(ids, w, padding_idx=pad), w, dout)[0]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert got[4].abs().sum() == 0


def check_scaled(device: str) -> None:
    """scaled (Triton: x * s in fp32, written as a given dtype) against its twin: bf16 and fp32
    inputs, a length that is not a multiple of the block, an empty tensor."""
    assert ce.use_triton(torch.empty(1, device=device), ndim=None), "the Triton path is not taken"
    gen = torch.Generator(device).manual_seed(5)
    s = torch.tensor(1 / 3000, device=device)
    for n, src, dst in [(5000, torch.float32, torch.float32), (4096 * 3 + 7, torch.float32, torch.bfloat16),
                        (77, torch.bfloat16, torch.bfloat16), (0, torch.float32, torch.bfloat16)]:
        x = torch.randn(n, device=device, generator=gen).to(src)
        got, want = ce.scaled(x, s, dst), ce.scaled_reference(x, s, dst)
        assert got.dtype == dst, (n, src, dst)  # within one bf16 step (the interpreter truncates)
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7 if dst == torch.bfloat16 else 1e-6, atol=0)


def check_expert_bias(device: str) -> None:
    """add_expert_bias (Triton add, segmented-sum backward) against the twins: experts with no rows,
    one row, and more rows than a block, widths that are not a multiple of the block."""
    gen = torch.Generator(device).manual_seed(3)
    cases = [([3, 0, 70, 1, 0], 40), ([0, 0], 8), ([5], 3)] + ([([100, 0, 3000, 7], 5760)] if device == "cuda" else [])
    for counts, W in cases:
        offsets = torch.cumsum(torch.tensor(counts), 0).to(torch.int32).to(device)
        N = sum(counts)
        for dtype in ([torch.float32, torch.bfloat16] if device == "cuda" else [torch.float32]):
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            rows = torch.randn(N, W, device=device, generator=gen).to(dtype).requires_grad_()
            bias = torch.randn(len(counts), W, device=device, generator=gen).requires_grad_()
            expert = eb.row_experts(offsets, N)
            out = eb.add_expert_bias(rows, bias, offsets)
            want = eb.add_bias_reference(rows.detach().float(), bias.detach(), expert)
            dout = torch.randn(N, W, device=device, generator=gen).to(dtype)
            drows, dbias = torch.autograd.grad(out, [rows, bias], dout)
            want_dbias = eb.segment_sum_reference(dout, offsets, len(counts), expert)
            assert torch.equal(drows, dout)
            for got, ref in [(out, want), (dbias, want_dbias)]:
                err = ((got.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30)).item()
                assert err < tol or ref.numel() == 0, (counts, W, dtype, err)
            for e, c in enumerate(counts):
                if c == 0:
                    assert dbias[e].abs().sum() == 0


def check_adamw(device: str) -> None:
    """The kernel against its twin (ragged sizes, bf16 states on CUDA, with and without clipping's
    factor), then the optimizer against torch.optim.AdamW over several steps (the factor given to
    ours, the gradients scaled by it for torch's): same numbers, same state format."""
    from pithtrain.train.optim import AdamW, set_lr

    assert use_triton(torch.empty(1, device=device), ndim=None), "the Triton path is not taken"
    gen = torch.Generator(device).manual_seed(3)
    sizes = [1, 4097, 0, 3 * aw.BLOCK + 5] + ([1 << 22] if device == "cuda" else [])
    for dtype in ([torch.float32, torch.bfloat16] if device == "cuda" else [torch.float32]):
        for i, (n, scale) in enumerate(zip(sizes, [None, torch.tensor(0.25, device=device)] * 3)):
            p, g, m = (torch.randn(n, device=device, generator=gen).to(dtype) for _ in range(3))
            v = torch.rand(n, device=device, generator=gen).to(dtype)
            step = torch.tensor(7.0, device=device)
            want = [t.clone() for t in (p, g, m, v)]
            lr = torch.tensor(1e-2, device=device) if i % 3 == 2 else 1e-2  # read from the device by the kernel
            aw.adamw_update(p, g, m, v, step, lr, 0.9, 0.95, 1e-8, 0.1, scale)
            aw.adamw_reference(*want, step, 1e-2, 0.9, 0.95, 1e-8, 0.1, scale)
            for got, ref in zip((p, m, v), (want[0], want[2], want[3])):
                tol = 1e-6 if dtype == torch.float32 else 1e-2
                assert ((got.float() - ref.float()).norm() <= tol * ref.float().norm() + 1e-12), (n, dtype)

    def params():
        g = torch.Generator(device).manual_seed(4)
        return [torch.nn.Parameter(torch.randn(*s, device=device, generator=g)) for s in [(33, 17), (5000,), (3,)]]

    def groups(ps):
        return [{"params": ps[:2], "weight_decay": 0.1}, {"params": ps[2:], "weight_decay": 0.0}]

    ours, ref = params(), params()
    kw = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    opts = [AdamW(groups(ours), **kw), torch.optim.AdamW(groups(ref), **kw)]
    for it in range(5):
        scale = torch.tensor(0.5 + 0.1 * it, device=device) if it % 2 else None
        lr = 3e-3 / (it + 1)  # steps 3 and 4: ours at a device tensor's rate, the groups' own lr left behind
        for ps, opt in zip((ours, ref), opts):
            g = torch.Generator(device).manual_seed(10 + it)
            for p in ps:
                p.grad = torch.randn(p.shape, device=device, generator=g)
            if opt is opts[0]:
                if it < 3:
                    set_lr(opt, lr)
                opt.step(grad_scale=scale, lr=torch.tensor(lr, device=device) if it >= 3 else None)
            else:
                set_lr(opt, lr)
                for p in ps:
                    p.grad *= 1.0 if scale is None else scale
                opt.step()
    for a, b in zip(ours, ref):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (a - b).abs().max()
    s0, s1 = opts[0].state_dict()["state"], opts[1].state_dict()["state"]
    assert s0.keys() == s1.keys() and all(s0[k].keys() == s1[k].keys() for k in s0)
    assert all(float(s0[k]["step"]) == float(s1[k]["step"]) == 5 for k in s0)
    with pytest.raises(ValueError, match="kernel's path only"):  # torch's own step would not read it
        AdamW(params(), lr=1e-3, amsgrad=True).step(lr=torch.tensor(1e-3, device=device))


def check_squares_sum(device: str) -> None:
    """The kernel's sum of squares against a float64 sum (ragged sizes around the tile, one empty
    tensor, one non-contiguous one taken by the twin, bf16 and fp32), and the same bits every run."""
    gen = torch.Generator(device).manual_seed(6)
    sizes = [1, aw.SQ_BLOCK - 1, 0, 3 * aw.SQ_BLOCK + 5, 777]
    for dtype in [torch.float32, torch.bfloat16]:
        ts = [(torch.randn(n, device=device, generator=gen) * (i + 1)).to(dtype) for i, n in enumerate(sizes)]
        ts.append(torch.randn(64, 48, device=device, generator=gen).to(dtype).T)  # non-contiguous
        want = sum(t.double().square().sum() for t in ts)
        got = aw.squares_sum(ts)
        assert got.dtype == torch.float32 and got.shape == ()
        assert abs(got.double() - want) <= 1e-5 * want, (dtype, got.item(), want.item())
        assert torch.equal(aw.squares_sum(ts), got)
    assert aw.squares_sum([torch.empty(0, device=device)]).item() == 0.0


def check_adamw_on_dtensors() -> None:
    """FSDP's parameters are DTensors: the kernel runs on their local shards and matches
    torch.optim.AdamW stepping the same DTensors (one gloo process, a 1-rank mesh)."""
    import socket

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from pithtrain.train.optim import AdamW

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        gen = torch.Generator().manual_seed(5)
        full = [torch.randn(40, 6, generator=gen), torch.randn(7, generator=gen)]
        grads = [torch.randn_like(t) for t in full]
        sets = []
        for _ in range(2):
            ps = [torch.nn.Parameter(distribute_tensor(t.clone(), mesh, [Shard(0)])) for t in full]
            for p, g in zip(ps, grads):
                p.grad = distribute_tensor(g.clone(), mesh, [Shard(0)])
            sets.append(ps)
        ours = AdamW(sets[0], lr=1e-2, weight_decay=0.1, foreach=False)
        ref = torch.optim.AdamW(sets[1], lr=1e-2, weight_decay=0.1, foreach=False)
        for _ in range(3):
            ours.step(), ref.step()
        for a, b in zip(*sets):
            assert isinstance(a, DTensor) and isinstance(ours.state[a]["exp_avg"], DTensor)
            assert torch.allclose(a.full_tensor(), b.full_tensor(), rtol=1e-5, atol=1e-6)
    finally:
        dist.destroy_process_group()


def run_all(device: str) -> None:
    """Every check, each proving that its kernels ran (launches counted by name)."""
    with counting_launches():
        with kernels_run("_adamw"):
            check_adamw(device)
            if device == "cpu":
                check_adamw_on_dtensors()
        with kernels_run("_squares"):
            check_squares_sum(device)
        with kernels_run("_add_bias_kernel", "_segment_sum_kernel"):
            check_expert_bias(device)
        with kernels_run("_gated_forward", "_gated_backward"):
            check_swiglu(device)
        with kernels_run("_scatter_rows_kernel", "_sum_slots_kernel"):
            check_permute(device)
        with kernels_run("_ce_forward_kernel", "_ce_backward_kernel"):
            check_cross_entropy_rows(device)
        with kernels_run("_scale_kernel"):
            check_scaled(device)
        with kernels_run("_embedding_backward_kernel"):
            check_embedding(device)


def compile_for(signatures: list, arch: int = 90) -> list[str]:
    """Compile each recorded launch (`SIGNATURES`, as JSON lists) for CUDA capability `arch` with
    Triton's own compiler and ptxas, no GPU needed: the interpreter accepts code that the compiler
    refuses (types, layouts, unsupported ops). Returns the kernels compiled."""
    import importlib

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    done = []
    for module, name, types, consts, warps in signatures:
        fn = getattr(importlib.import_module(module), name)
        # as recorded (the CPU checks run fp32), and with bf16 in place of fp32 tensors, as a GPU run holds
        for to in ("*fp32", "*bf16"):
            sig = {**{n: to if t == "*fp32" else t for n, t in types}, **{n: "constexpr" for n, _ in consts}}
            sig = {n: sig[n] for n in fn.arg_names}
            src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(n),): v for n, v in consts})
            compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
        done.append(name)
    return done


if __name__ == "__main__":
    run_all(sys.argv[1] if len(sys.argv) > 1 else "cpu")
    if len(sys.argv) > 2:  # where to write the launches' signatures, for `compile_for`
        import json

        with open(sys.argv[2], "w") as f:
            json.dump({"launched": sorted(LAUNCHED), "signatures": sorted(SIGNATURES, key=repr)}, f)
    print("kernel checks passed")
