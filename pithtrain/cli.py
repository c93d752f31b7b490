"""`pithtrain train | eval | build-corpus | convert | demo | memory | bench`: the command line."""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys

from pithtrain.config import ConfigError, load_config

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def cmd_train(args) -> int:
    from pithtrain.parallel.mesh import process_rank
    from pithtrain.train.loop import train

    cfg = load_config(args.config, args.overrides)
    summary = train(cfg)
    if process_rank() == 0:
        print_summary(summary)
    return 0


def cmd_eval(args) -> int:
    from pithtrain.parallel.mesh import process_rank
    from pithtrain.train.loop import evaluate_checkpoint

    r = evaluate_checkpoint(load_config(args.config, args.overrides), args.checkpoint)
    if process_rank() == 0:
        for note in r["notes"]:
            print(f"note: {note}")
        print(f"validation loss of {r['checkpoint']}: {r['val_loss']:.4f} (perplexity {math.exp(min(r['val_loss'], 700)):.2f}; "
              f"{r['windows']} windows of {r['seq_len']} tokens)")
    return 0


def print_summary(s: dict) -> None:
    print(f"run directory: {s['run_dir']}")
    if "train_loss" in s:
        val = "n/a" if s.get("val_loss") is None else f"{s['val_loss']:.4f}"
        last = s.get("preempted_at") or s.get("paused_at") or s["steps"]
        when = "final" if s.get("logged_step", last) == last else f"last logged (step {s['logged_step']})"
        print(f"{when} train loss: {s['train_loss']:.4f}   validation loss: {val}")
        print(f"throughput: {s['tokens_per_s']:,.0f} tokens/s (after the first logged interval, which compiles "
              "and warms up, when there are others)")
    if s.get("skipped_steps"):
        print(f"skipped steps: {s['skipped_steps']}")
    if s.get("paused_at"):
        print(f"paused after step {s['paused_at']} (train.stop_at; checkpoint saved; resume with "
              "checkpoint.resume=auto)")
    if s.get("preempted_at"):
        print(f"stopped by SIGTERM after step {s['preempted_at']} (checkpoint saved; resume with "
              "checkpoint.resume=auto)")
    if s.get("plot"):
        print(f"loss curve: {s['plot']}")


def cmd_build_corpus(args) -> int:
    from pithtrain.train.corpus import run_build_corpus

    return run_build_corpus(args)


def parse_size(text: str) -> int:
    """'5GB', '500MB', '1.5GiB' or a plain byte count -> bytes (positive); GB = 10^9 and GiB = 2^30,
    as transformers' `save_pretrained(max_shard_size=...)` reads them."""
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "KB": 10**3, "MB": 10**6, "GB": 10**9,
             "TB": 10**12}
    t = text.strip().upper()
    unit = next((u for u in units if t.endswith(u)), "")
    factor, number = units.get(unit, 1), t[:len(t) - len(unit)]
    try:
        size = int(float(number) * factor) if factor > 1 else int(number)
    except (ValueError, OverflowError):  # inf, nan or beyond a float
        size = 0
    if size <= 0:
        raise ConfigError(f"--max-shard-size {text!r}: give a positive byte count or a size like 500MB / 5GB")
    return size


def cmd_convert(args) -> int:
    import json

    import torch

    from pithtrain.train import hf

    if args.direction == "hf-to-dcp":
        given = [o for o, v in (("--config", args.config), ("--dtype", args.dtype),
                                ("--max-shard-size", args.max_shard_size)) if v is not None]
        if given:
            raise ConfigError(f"{', '.join(given)}: dcp-to-hf options; hf-to-dcp keeps the folder's config.json and "
                              "dtypes (nothing was written)")
        info = hf.hf_to_dcp(args.src, args.out, tokenizer=args.tokenizer)
        print(f"wrote {info['tensors']} tensors to {args.out} (DCP); use it with checkpoint.init_from={args.out}")
    else:
        config = None
        if args.config:
            try:
                with open(args.config) as f:
                    config = json.load(f)
            except (OSError, ValueError) as e:
                raise ConfigError(f"--config {args.config}: {e}") from None
            if not isinstance(config, dict):
                raise ConfigError(f"--config {args.config}: not a JSON object (a model's config.json)")
        dtype = {"keep": None, "bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or "keep"]
        info = hf.dcp_to_hf(args.src, args.out, hf_config=config, tokenizer=args.tokenizer, dtype=dtype,
                            max_shard_bytes=parse_size(args.max_shard_size or "5GB"))
        print(f"wrote {info['tensors']} tensors in {info['shards']} shards to {args.out}")
        if info["outside_vocab"]:
            print(f"{args.out}/config.json: {', '.join(info['outside_vocab'])}: no token of the vocabulary (a "
                  "generation can neither start with nor stop on such an id); train with model.eos_token_id / "
                  "model.bos_token_id set to the tokenizer's ids, or edit that file", file=sys.stderr)
    if info["tokenizer_files"]:
        print(f"taken along: {', '.join(info['tokenizer_files'])}")
    if not set(info["tokenizer_files"]) & set(hf.TOKENIZER_FILES):
        print(f"no tokenizer files in {args.src}: {args.out} has none; pass --tokenizer FOLDER (a corpus folder "
              "or the model's hub folder) to take them along", file=sys.stderr)
    return 0


def cmd_demo(args) -> int:
    """Build the demo corpus (once) and train the tiny MoE on it, in one process."""
    from pithtrain.parallel.mesh import world_size
    from pithtrain.train.corpus import DEMO, build_corpus
    from pithtrain.train.loop import train

    if world_size() > 1:  # every process would build the corpus and remove the last run at once
        raise ConfigError("`pithtrain demo` runs in one process; under torchrun, build the corpus with one "
                          "`pithtrain demo` first, then launch `pithtrain train examples/demo/demo.toml "
                          "data.corpus=runs/demo-corpus ...` (AGENTS.md has the command)")
    corpus = os.path.join(args.work_dir, "demo-corpus")
    run_dir = os.path.join(args.work_dir, "demo-run")
    toml = os.path.join(EXAMPLES, "demo", "demo.toml")
    if not os.path.exists(toml):
        raise ConfigError(f"{toml} not found: run the demo from a source checkout (or `pip install -e .`)")
    cfg = load_config(toml, [f"data.corpus={corpus}", f"log.run_dir={run_dir}"] + args.overrides)  # checked before the corpus is built
    if cfg.data.corpus == os.path.abspath(corpus) and not os.path.exists(os.path.join(corpus, "meta.json")):
        print(f"building the demo corpus in {corpus} (Python standard library sources)", flush=True)
        meta = build_corpus([DEMO], corpus, None, workers=args.workers, demo_vocab_size=4096,
                            val_fraction=0.02)
        print(f"  {meta['splits']['train']['tokens']:,} train / {meta['splits']['val']['tokens']:,} "
              f"validation tokens", flush=True)
    # its own output: each demo starts afresh; a log.run_dir of the user's is theirs, refused as `train`
    # refuses a run directory that holds a run. Kept when asked to resume it; never removed when it
    # is not a demo run or holds the weights named by checkpoint.init_from
    if (cfg.log.run_dir == os.path.abspath(run_dir) and os.path.lexists(run_dir)
            and cfg.checkpoint.resume == "none"):
        init = cfg.checkpoint.init_from and os.path.abspath(cfg.checkpoint.init_from)
        if os.path.islink(run_dir) or not os.path.isfile(os.path.join(run_dir, "run_config.json")):
            raise ConfigError(f"{run_dir} is not a demo run (no run_config.json) and the demo would replace it: "
                              "move it, or pass --work-dir or log.run_dir")
        if init and os.path.commonpath([init, os.path.abspath(run_dir)]) == os.path.abspath(run_dir):
            raise ConfigError(f"checkpoint.init_from {cfg.checkpoint.init_from} lies in the previous demo run, which "
                              "the demo replaces: copy it elsewhere first, or resume with checkpoint.resume=auto")
        print(f"removing the previous demo run {run_dir}", flush=True)
        shutil.rmtree(run_dir)
    print_summary(train(cfg))
    return 0


def cmd_memory(args) -> int:
    from pithtrain.parallel.mesh import plan_layout
    from pithtrain.tools.memory import GB, check_fits, estimate_for_run
    from pithtrain.train.loop import autocast_dtype, check_graphs

    cfg = load_config(args.config, args.overrides)
    if args.world < 1:
        raise ConfigError(f"--world {args.world}: give the number of ranks, 1 or more")
    if not 0 <= args.device_gb < float("inf"):  # nan fails this too
        raise ConfigError(f"--device-gb {args.device_gb:g}: give the device's memory in GiB (0: no check)")
    layout = plan_layout(cfg, args.world)
    device_type = "cpu" if cfg.train.device == "cpu" else "cuda"  # train.device=auto: planned for a GPU
    check_graphs(cfg, device_type, layout.world, layout.world > 1 or args.torchrun)
    autocast = autocast_dtype(cfg, device_type) is not None
    est = estimate_for_run(cfg, layout.world, layout.cp, autocast=autocast, data_ranks=layout.data_ranks,
                           sharded=True if args.torchrun else None)
    print("\n".join(est.lines()))
    if args.device_gb:
        check_fits(est, int(args.device_gb * GB), layout.world, cfg)
        print(f"fits in {args.device_gb:g} GB")
    return 0


def cmd_bench(bench_args: list[str]) -> int:
    import runpy

    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "single_gpu.py")
    if not os.path.isfile(script):
        raise ConfigError(f"{script} not found: `pithtrain bench` runs from a source checkout of PithTrain")
    import torch

    if not torch.cuda.is_available() and not {"-h", "--help"} & set(bench_args):
        raise ConfigError("`pithtrain bench` times training steps on a CUDA GPU, and torch sees none here")
    runpy.run_path(script, run_name="pithtrain_bench")["main"](bench_args, prog="pithtrain bench")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pithtrain", description="Train mixture-of-experts language models.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train from a TOML config")
    p.add_argument("config", help="run config (TOML)")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides (model.FIELD=value for the HF config)")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("eval", help="validation loss of a checkpoint's weights on a run config's corpus, no training")
    p.add_argument("config", help="run config (TOML): model, data.corpus, data.val_batches, layout")
    p.add_argument("checkpoint", help="a training checkpoint (step-N folder) or a converted one (convert hf-to-dcp)")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides")
    p.set_defaults(func=cmd_eval)

    from pithtrain.train.corpus import add_build_corpus_args

    p = sub.add_parser("build-corpus", help="tokenize text files into a packed corpus")
    add_build_corpus_args(p)
    p.set_defaults(func=cmd_build_corpus)

    p = sub.add_parser("convert", help="Hugging Face safetensors <-> DCP checkpoints")
    p.add_argument("direction", choices=["hf-to-dcp", "dcp-to-hf"])
    p.add_argument("src", help="a Hugging Face folder (hf-to-dcp) or a DCP checkpoint directory (dcp-to-hf)")
    p.add_argument("out", help="the output directory; it must not exist")
    p.add_argument("--tokenizer", help="copy the tokenizer files from this folder (default: from src)")
    p.add_argument("--config", help="dcp-to-hf: the model's config.json (default: the one in the checkpoint)")
    p.add_argument("--dtype", choices=["keep", "bf16", "fp32"],
                   help="dcp-to-hf: dtype of the floating tensors written (default: keep, as stored)")
    p.add_argument("--max-shard-size", help="dcp-to-hf: bytes per safetensors shard, e.g. 500MB or 2GiB "
                   "(default 5GB; GB = 10^9 bytes, as transformers reads it)")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("demo", help="build the demo corpus and train the tiny MoE demo model on it")
    p.add_argument("--work-dir", default="runs", help="where the corpus and the run go (default: runs)")
    p.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1))
    p.add_argument("overrides", nargs="*", help="section.key=value overrides of examples/demo/demo.toml")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("memory", help="estimate the peak memory per rank of a training run, nothing allocated")
    p.add_argument("config", help="run config (TOML)")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides")
    p.add_argument("--world", type=int, default=1, help="number of ranks (default 1)")
    p.add_argument("--torchrun", action="store_true", help="launched by torchrun, which FSDP-wraps even one rank "
                   "(gathered copies and reduction buffers), as train then counts it (default: only when --world > 1)")
    p.add_argument("--device-gb", type=float, default=0, help="also check against a device of this many GB of "
                   "2^30 bytes, as torch reports it (a card sold as '80 GB' holds fewer: torch.cuda.mem_get_info()[1] / 2**30)")
    p.set_defaults(func=cmd_memory)

    sub.add_parser("bench", help="GPU benchmark, ours vs Hugging Face in one process: benchmarks/single_gpu.py "
                                 "with the options that follow (pithtrain bench --help lists them)")

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # everything after it belongs to the benchmark's own parser
        command = lambda: cmd_bench(argv[1:])  # noqa: E731
    else:
        args, extra = parser.parse_known_args(argv)
        if extra:  # overrides after an option (`memory run.toml --world 2 data.seq_len=16`) are overrides still
            if not hasattr(args, "overrides") or any(x.startswith("-") or "=" not in x for x in extra):
                parser.error(f"unrecognized arguments: {' '.join(extra)}")
            args.overrides += extra
        command = lambda: args.func(args)  # noqa: E731
    from pithtrain.train.checkpoint import CheckpointError
    from pithtrain.train.corpus import CorpusError
    from pithtrain.train.guard import TrainingHalted

    try:
        return command()
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except (CorpusError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except TrainingHalted as e:
        rank = os.environ.get("RANK", "0")
        print(f"training halted (rank {rank}): {e}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        return 130
