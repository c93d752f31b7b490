"""Context parallelism: ring attention over the cp ranks that split each sequence.

Load balance (zigzag). A sequence of S tokens is cut into 2 * cp blocks of c = S / (2 * cp);
rank r holds blocks r and 2 * cp - 1 - r, an early one and a late one, so every rank has the same
amount of causal work. `shard_sequence` cuts token tensors that way and `block_positions` gives
the positions of a rank's tokens (RoPE and the causal mask follow them).

Forward. Each rank keeps its queries; the key/value blocks travel around the ring (rank r sends
to r + 1). At step i a rank holds the K/V of rank r - i and computes, for each of its two query
blocks against each of the two key blocks, the attention output and the log-sum-exp (LSE) of the
scores; pairs that the causal mask (or the sliding window) hides entirely are skipped. Partial
results merge exactly: lse = logaddexp(lse_a, lse_b), out = out_a e^(lse_a - lse) + out_b e^(lse_b - lse).
The next K/V block is sent with asynchronous point-to-point before the current one is computed,
so the transfer hides under the block computation; at most two K/V blocks are alive (the one in
use and the one arriving) whatever the cp degree, and only the rank's own K/V are saved for
backward.

Backward. The K/V blocks go around the ring again with their gradient accumulators: each rank
recomputes the block's probabilities from the saved LSE, adds its dQ locally and its dK/dV into the
travelling accumulator; after a full turn the accumulator reaches the block's owner. GQA runs
without expanding K/V (the query heads of a group are stacked along the query axis); MLA works
unchanged (its value size may differ from its key size). Sinks (GPT-OSS) join after the ring:
the sink logit is one more term of the LSE, and autograd takes it from there.

The block math is plain PyTorch in fp32 (CPU and GPU alike; autocast off inside it, as forward
and backward must agree); a fused kernel can replace
`_block_forward` / `_block_backward` without touching the ring. A group of size 1 (no
communication) runs the same math on the whole sequence: the tests compare it with `attend`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class ContextGroup:
    group: dist.ProcessGroup | None
    size: int
    rank: int


def shard_sequence(t: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's two blocks (r and 2cp-1-r) of `t` along `dim`."""
    if t.shape[dim] % (2 * cp):
        raise ValueError(f"shard_sequence: length {t.shape[dim]} must be a multiple of 2 x cp = {2 * cp}")
    if not 0 <= rank < cp:
        raise ValueError(f"shard_sequence: rank {rank} is not in [0, cp = {cp})")
    blocks = t.chunk(2 * cp, dim=dim)
    return torch.cat([blocks[rank], blocks[2 * cp - 1 - rank]], dim=dim)


def block_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Positions [seq_len / cp] of this rank's tokens."""
    return shard_sequence(torch.arange(seq_len, device=device), cp, rank, dim=0)


def _blocks(cp: int, rank: int) -> tuple[int, int]:
    return rank, 2 * cp - 1 - rank


def _visible(qb: int, kb: int, c: int, window: int | None) -> tuple[bool, bool]:
    """(any key of block kb visible to a query of block qb, a mask is needed)."""
    if kb > qb:
        return False, False
    if window is not None and (kb + 1) * c - 1 <= qb * c - window:
        return False, False
    partial = kb == qb or (window is not None and kb * c <= (qb + 1) * c - 1 - window)
    return True, partial


def _mask(qb: int, kb: int, c: int, window: int | None, groups: int, device) -> torch.Tensor:
    q = torch.arange(qb * c, (qb + 1) * c, device=device)[:, None]
    k = torch.arange(kb * c, (kb + 1) * c, device=device)[None, :]
    allowed = k <= q
    if window is not None:
        allowed &= k > q - window
    return allowed.repeat(groups, 1)  # query rows are (group member, position)


def _scores(q, k, scale, mask):
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def _block_forward(q, k, v, scale, mask):
    """q [B, Hk, g*c, D], k [B, Hk, c, D], v [B, Hk, c, Dv] (fp32) -> out, lse."""
    s = _scores(q, k, scale, mask)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return torch.matmul(p, v), lse


def _block_backward(q, k, v, dout, lse, delta, scale, mask):
    s = _scores(q, k, scale, mask)
    p = torch.exp(s - lse[..., None])
    dv = torch.matmul(p.transpose(-1, -2), dout)
    ds = p * (torch.matmul(dout, v.transpose(-1, -2)) - delta[..., None])
    return torch.matmul(ds, k) * scale, torch.matmul(ds.transpose(-1, -2), q) * scale, dv


def _merge(out, lse, out_b, lse_b):
    new = torch.logaddexp(lse, lse_b)
    safe = torch.where(torch.isinf(new), 0.0, new)
    return out * torch.exp(lse - safe)[..., None] + out_b * torch.exp(lse_b - safe)[..., None], new


def _start_ring(tensors: list[torch.Tensor], cp: ContextGroup) -> tuple[list, list[torch.Tensor]]:
    """Send `tensors` to the next rank and receive the previous rank's into new buffers (async)."""
    recv = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, group=cp.group, group_peer=(cp.rank + 1) % cp.size) for t in tensors]
    ops += [dist.P2POp(dist.irecv, t, group=cp.group, group_peer=(cp.rank - 1) % cp.size) for t in recv]
    return dist.batch_isend_irecv(ops), recv


def _wait(reqs) -> None:
    for r in reqs:
        r.wait()


def _group_queries(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, Hq, S, D] -> [B, Hk, g*S, D]: the g query heads sharing a K/V head stacked."""
    B, Hq, S, D = q.shape
    return q.reshape(B, kv_heads, Hq // kv_heads * S, D)


def _halves(x: torch.Tensor, groups: int) -> list[torch.Tensor]:
    """Rows (group member, position) of the early and the late block of a [B, Hk, g*S, ...] tensor."""
    B, Hk, GS = x.shape[:3]
    y = x.view(B, Hk, groups, 2, GS // groups // 2, *x.shape[3:])
    return [y[:, :, :, h].reshape(B, Hk, GS // 2, *x.shape[3:]) for h in (0, 1)]


def _join(halves: list[torch.Tensor], groups: int) -> torch.Tensor:
    a, b = halves
    B, Hk, GC = a.shape[:3]
    shape = (B, Hk, groups, 1, GC // groups, *a.shape[3:])
    return torch.cat([a.reshape(shape), b.reshape(shape)], dim=3).reshape(B, Hk, 2 * GC, *a.shape[3:])


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cp: ContextGroup, scale: float, window):
        Hk, groups = k.shape[1], q.shape[1] // k.shape[1]
        c = k.shape[2] // 2
        qg = _group_queries(q.float(), Hk)
        q_halves = _halves(qg, groups)
        mine = _blocks(cp.size, cp.rank)
        outs = [None, None]
        lses = [None, None]
        kv = [k.float().contiguous(), v.float().contiguous()]
        for step in range(cp.size):
            reqs, incoming = _start_ring(kv, cp) if step < cp.size - 1 else ([], None)
            theirs = _blocks(cp.size, (cp.rank - step) % cp.size)
            for qh in (0, 1):
                for kh in (0, 1):
                    visible, partial = _visible(mine[qh], theirs[kh], c, window)
                    if not visible:
                        continue
                    mask = _mask(mine[qh], theirs[kh], c, window, groups, q.device) if partial else None
                    o, l = _block_forward(q_halves[qh], kv[0][:, :, kh * c:(kh + 1) * c],
                                          kv[1][:, :, kh * c:(kh + 1) * c], scale, mask)
                    if outs[qh] is None:
                        outs[qh], lses[qh] = o, l
                    else:
                        outs[qh], lses[qh] = _merge(outs[qh], lses[qh], o, l)
            _wait(reqs)
            kv = incoming
        out, lse = _join(outs, groups), _join(lses, groups)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cp, ctx.scale, ctx.window = cp, scale, window
        B, Hq, S = q.shape[:3]
        return out.view(B, Hq, S, -1).to(q.dtype), lse.view(B, Hq, S)

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        cp, scale, window = ctx.cp, ctx.scale, ctx.window
        Hk, groups = k.shape[1], q.shape[1] // k.shape[1]
        c = k.shape[2] // 2
        dout = _group_queries(dout.float(), Hk)
        delta = (dout * out).sum(-1)  # rowsum(dO * O), the softmax-backward correction
        if dlse is not None:
            delta = delta - _group_queries(dlse.float().unsqueeze(-1), Hk).squeeze(-1)
        q_h, do_h, lse_h, delta_h = (_halves(t, groups) for t in (_group_queries(q.float(), Hk), dout, lse, delta))
        dq = [torch.zeros_like(q_h[0]), torch.zeros_like(q_h[1])]
        mine = _blocks(cp.size, cp.rank)
        kv = [k.float().contiguous(), v.float().contiguous()]
        grad_reqs, grad_in = [], None
        for step in range(cp.size):
            reqs, incoming = _start_ring(kv, cp) if step < cp.size - 1 else ([], None)
            theirs = _blocks(cp.size, (cp.rank - step) % cp.size)
            dk, dv = torch.zeros_like(kv[0]), torch.zeros_like(kv[1])
            for qh in (0, 1):
                for kh in (0, 1):
                    visible, partial = _visible(mine[qh], theirs[kh], c, window)
                    if not visible:
                        continue
                    mask = _mask(mine[qh], theirs[kh], c, window, groups, q.device) if partial else None
                    ks = slice(kh * c, (kh + 1) * c)
                    gq, gk, gv = _block_backward(q_h[qh], kv[0][:, :, ks], kv[1][:, :, ks], do_h[qh], lse_h[qh],
                                                 delta_h[qh], scale, mask)
                    dq[qh] += gq
                    dk[:, :, ks] += gk
                    dv[:, :, ks] += gv
            _wait(grad_reqs)  # the accumulated gradient of this block from the ranks before
            if grad_in is not None:
                dk, dv = dk + grad_in[0], dv + grad_in[1]
            if cp.size == 1:  # one rank (tests of the block math): the gradient is already home
                grad_in = [dk, dv]
                break
            grad_reqs, grad_in = _start_ring([dk, dv], cp)  # on to the next holder; the last hop: its owner
            _wait(reqs)
            kv = incoming
        _wait(grad_reqs)
        dq = _join(dq, groups).view(q.shape)
        return dq.to(q.dtype), grad_in[0].to(k.dtype), grad_in[1].to(v.dtype), None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: ContextGroup, *, scale: float,
                   window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of this rank's two blocks against the whole sequence.
    q [B, Hq, 2c, D], k [B, Hk, 2c, D], v [B, Hk, 2c, Dv] -> [B, Hq, 2c, Dv]."""
    # Autocast (the training forward) would cast the fp32 block matmuls back to bf16 in forward but not
    # in backward, which runs outside it: off here, so both passes do the same fp32 math.
    with torch.autocast(q.device.type, enabled=False):
        out, lse = _RingAttention.apply(q, k, v, cp, scale, window)
        if sinks is None:
            return out
        total = torch.logaddexp(lse, sinks.float()[None, :, None])  # the sink is one more softmax term
        return (out.float() * torch.exp(lse - total)[..., None]).to(q.dtype)
