"""Checkpoint save and load time of a ~1.2 B-parameter model with its AdamW states, on one GPU.

    PYTHONPATH=. python benchmarks/checkpoint_io.py [--dir /tmp/ckpt] [--layers 1] [--weights fp32]

The model is the Qwen3-30B-A3B example cut to `--layers` layers (1 layer: 1.25 B parameters, with
its 151,936-token embedding and head). One optimizer step fills the AdamW moments; then
`train/checkpoint.save` (DCP files, fsync, CRC-32 of every file, atomic rename) and
`train/checkpoint.load` into a freshly built model and optimizer (CRC check included) are timed
with wall clocks, and the loaded weights and moments are compared with the saved ones. The CRC
pass alone (`verify(checksums=True)`, files in the page cache) and a peer, one `torch.save` of
the same model and optimizer state dicts to one fsynced file, are timed in the same run.
"""

import argparse
import json
import os
import shutil
import time

import torch

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


def build(cfg: dict, weights: str, device: str):
    from pithtrain.config import OptimConfig
    from pithtrain.layers.transformer import cast_parameters, init_weights
    from pithtrain.models import build_model
    from pithtrain.train.optim import build_optimizer

    with torch.device(device):
        model = build_model(cfg)
    init_weights(model, 0)
    if weights == "bf16":
        cast_parameters(model, torch.bfloat16)
    return model, build_optimizer(model, OptimConfig())


def main() -> None:
    from pithtrain.train import checkpoint

    p = argparse.ArgumentParser()
    p.add_argument("--dir", default="/tmp/pithtrain-ckpt-bench")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--weights", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--config", default=os.path.join(EXAMPLES, "qwen3_30b_a3b", "config.json"))
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    with open(args.config) as f:
        cfg = {**json.load(f), "num_hidden_layers": args.layers}
    model, opt = build(cfg, args.weights, args.device)
    for q in model.parameters():
        q.grad = torch.randn_like(q) * 1e-3
    opt.step()
    shutil.rmtree(args.dir, ignore_errors=True)
    sync()
    t0 = time.perf_counter()
    path = checkpoint.save(args.dir, 1, model, opt, {}, keep=1, hf_config=cfg)
    save_s = time.perf_counter() - t0
    nbytes = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))
    model2, opt2 = build(cfg, args.weights, args.device)
    for q in model2.parameters():  # the optimizer states exist before loading, as on resume
        q.grad = torch.zeros_like(q)
    opt2.step()
    sync()
    t0 = time.perf_counter()
    checkpoint.load(path, model2, opt2)
    sync()
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    checkpoint.verify(path, checksums=True)
    crc_s = time.perf_counter() - t0
    peer = os.path.join(args.dir, "peer.pt")  # the peer: one torch.save of the same state, fsynced
    t0 = time.perf_counter()
    with open(peer, "wb") as f:
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, f)
        f.flush()
        os.fsync(f.fileno())
    peer_save_s = time.perf_counter() - t0
    os.remove(peer)
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
    same &= all(torch.equal(opt.state[a]["exp_avg_sq"], opt2.state[b]["exp_avg_sq"])
                for a, b in zip(model.parameters(), model2.parameters()))
    n = sum(q.numel() for q in model.parameters())
    print(json.dumps(dict(parameters=n, weights=args.weights, checkpoint_GB=nbytes / 1e9, save_s=save_s,
                          load_s=load_s, checksum_s=crc_s, files=len(os.listdir(path)),
                          peer_torch_save_s=peer_save_s, save_vs_peer=peer_save_s / save_s, save_GBps=nbytes / 1e9 / save_s, load_GBps=nbytes / 1e9 / load_s,
                          identical_after_load=bool(same), device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu"), indent=1))
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
