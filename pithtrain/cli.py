"""`pithtrain train | build-corpus | demo`: the command line."""

from __future__ import annotations

import argparse
import os
import shutil
import sys

from pithtrain.config import ConfigError, load_config

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def cmd_train(args) -> int:
    from pithtrain.train.loop import train

    cfg = load_config(args.config, args.overrides)
    summary = train(cfg)
    print_summary(summary)
    return 0


def print_summary(s: dict) -> None:
    print(f"run directory: {s['run_dir']}")
    if "train_loss" in s:
        val = "n/a" if s.get("val_loss") is None else f"{s['val_loss']:.4f}"
        print(f"final train loss: {s['train_loss']:.4f}   validation loss: {val}")
        print(f"throughput: {s['tokens_per_s']:,.0f} tokens/s")
    if s.get("plot"):
        print(f"loss curve: {s['plot']}")


def cmd_build_corpus(args) -> int:
    from pithtrain.train.data import run_build_corpus

    return run_build_corpus(args)


def cmd_demo(args) -> int:
    """Build the demo corpus (once) and train the tiny MoE on it."""
    from pithtrain.train.data import build_corpus
    from pithtrain.train.loop import train

    corpus = os.path.join(args.work_dir, "demo-corpus")
    if not os.path.exists(os.path.join(corpus, "meta.json")):
        print(f"building the demo corpus in {corpus} (Python standard library sources)", flush=True)
        meta = build_corpus(["demo"], corpus, None, workers=args.workers, demo_vocab_size=4096,
                            val_fraction=0.02)
        print(f"  {meta['splits']['train']['tokens']:,} train / {meta['splits']['val']['tokens']:,} "
              f"validation tokens", flush=True)
    run_dir = os.path.join(args.work_dir, "demo-run")
    if os.path.exists(run_dir):  # the demo's own output: each demo starts afresh
        print(f"removing the previous demo run {run_dir}", flush=True)
        shutil.rmtree(run_dir)
    overrides = [f"data.corpus={corpus}", f"log.run_dir={run_dir}"]
    toml = os.path.join(EXAMPLES, "demo", "demo.toml")
    if not os.path.exists(toml):
        raise ConfigError(f"{toml} not found: run the demo from a source checkout (or `pip install -e .`)")
    cfg = load_config(toml, overrides + args.overrides)
    summary = train(cfg)
    print_summary(summary)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pithtrain", description="Train mixture-of-experts language models.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train from a TOML config")
    p.add_argument("config", help="run config (TOML)")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides (model.FIELD=value for the HF config)")
    p.set_defaults(func=cmd_train)

    from pithtrain.train.data import add_build_corpus_args

    p = sub.add_parser("build-corpus", help="tokenize text files into a packed corpus")
    add_build_corpus_args(p)
    p.set_defaults(func=cmd_build_corpus)

    p = sub.add_parser("demo", help="build the demo corpus and train the tiny MoE demo model on it")
    p.add_argument("--work-dir", default="runs", help="where the corpus and the run go (default: runs)")
    p.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1))
    p.add_argument("overrides", nargs="*", help="section.key=value overrides of examples/demo.toml")
    p.set_defaults(func=cmd_demo)

    args = parser.parse_args(argv)
    from pithtrain.train.checkpoint import CheckpointError
    from pithtrain.train.data import CorpusError

    try:
        return args.func(args)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except (CorpusError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
