"""Dispatch bytes with and without deduplication for Qwen3-30B-A3B routing (128 experts, top-8,
hidden 2048, bf16 rows) on ep ranks: `python benchmarks/dedup_bytes.py [--ep 8] [--tokens 8192]`.

Deduplicated dispatch sends one row per distinct (token, destination rank) instead of one per
(token, expert); the combine sends the same number back. Routings (no trained router is at hand,
so these are synthetic; see docs/parallelism.md):
- uniform: each token's 8 experts uniformly at random (a well-balanced router);
- zipf-s: expert popularity p_i ~ 1 / (i + 1)^s, experts placed on ranks at random (a skewed router);
- clustered-q: with probability q each further expert is drawn from the rank of the token's first
  expert (experts that co-fire sit together).
Metadata per sent row (8 int64 ids + 8 fp32 weights = 96 bytes) is counted for the deduplicated
scheme; the plain scheme is charged 12 bytes per row (one id, one weight).
"""

import argparse

import torch

from pithtrain.parallel.expert import dispatch_rows

E, K, H, BYTES = 128, 8, 2048, 2


def uniform(n: int, gen) -> torch.Tensor:
    return torch.rand(n, E, generator=gen).topk(K, dim=-1).indices


def zipf(n: int, s: float, gen) -> torch.Tensor:
    p = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** s
    place = torch.randperm(E, generator=gen)  # popular experts land on random ranks
    return place[torch.multinomial(p.expand(n, E), K, replacement=False, generator=gen)]


def clustered(n: int, q: float, ep: int, gen) -> torch.Tensor:
    per = E // ep
    scores = torch.rand(n, E, generator=gen)
    first = scores.argmax(-1)
    home = first // per
    same = (torch.arange(E)[None, :] // per) == home[:, None]
    boost = (torch.rand(n, 1, generator=gen) < q) & same  # the whole home rank wins for this token
    return (scores + 2.0 * boost).topk(K, dim=-1).indices


def report(name: str, ids: torch.Tensor, ep: int) -> str:
    plain, dedup = dispatch_rows(ids, E, ep)
    mb_plain = plain * (H * BYTES + 12) / 2**20
    mb_dedup = dedup * (H * BYTES + 96) / 2**20
    return (f"| {name} | {plain / ids.shape[0]:.2f} | {dedup / ids.shape[0]:.2f} | {mb_plain:,.1f} | "
            f"{mb_dedup:,.1f} | {100 * (1 - mb_dedup / mb_plain):.1f}% |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ep", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=8192)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    n, ep = args.tokens, args.ep
    print(f"Qwen3-30B-A3B routing, {n} tokens per rank, ep {ep}: rows per token and MiB sent per rank "
          f"per MoE layer (dispatch; the combine sends the same back)")
    print("| routing | rows/token plain | rows/token dedup | MiB plain | MiB dedup | saved |")
    print("| --- | --- | --- | --- | --- | --- |")
    print(report("uniform", uniform(n, gen), ep))
    for s in (1.0, 1.5):
        print(report(f"zipf-{s}", zipf(n, s, gen), ep))
    for q in (0.5, 0.9):
        print(report(f"clustered-{q}", clustered(n, q, ep, gen), ep))


if __name__ == "__main__":
    main()
