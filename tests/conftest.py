import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A small Qwen3-MoE: two MoE layers around a dense one, 4 experts top-2.
TINY_MODEL = dict(model_type="qwen3_moe", vocab_size=512, hidden_size=32, intermediate_size=64,
                  moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
                  max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)


# Tiny configs of each family (the HF parity cases build on them; distributed tests widen the vocab).
QWEN3 = dict(model_type="qwen3_moe", vocab_size=97, hidden_size=32, intermediate_size=48,
             moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, num_experts=6, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
             mlp_only_layers=[1], max_position_embeddings=64, rope_theta=10000.0, rms_norm_eps=1e-6,
             tie_word_embeddings=False)
YARN = {"type": "yarn", "factor": 40.0, "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1,
        "original_max_position_embeddings": 16}
DEEPSEEK_V2 = dict(model_type="deepseek_v2", vocab_size=97, hidden_size=32, intermediate_size=48,
                   moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                   q_lora_rank=None, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                   n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=3, first_k_dense_replace=1,
                   topk_method="greedy", n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False,
                   max_position_embeddings=640, rope_theta=10000.0, rope_scaling=YARN, rms_norm_eps=1e-6,
                   tie_word_embeddings=False, initializer_range=0.1)
DEEPSEEK_V3 = dict(DEEPSEEK_V2, model_type="deepseek_v3", q_lora_rank=10, n_shared_experts=1, n_group=4,
                   topk_group=2, topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True,
                   routed_scaling_factor=2.5, rope_scaling=dict(YARN, mscale=1.0))
GPT_OSS = dict(model_type="gpt_oss", vocab_size=97, hidden_size=32, intermediate_size=16, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=6, num_experts_per_tok=2,
               sliding_window=5, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
               swiglu_limit=7.0, max_position_embeddings=512, rope_theta=150000.0,
               rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                             "truncate": False, "original_max_position_embeddings": 16},
               rms_norm_eps=1e-5, initializer_range=0.1, tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory):
    """A corpus of ~300 KB of standard-library source with a 512-token BPE tokenizer."""
    from pithtrain.train.corpus import build_corpus, demo_texts

    texts, size = [], 0
    for t in demo_texts():
        texts.append(t)
        size += len(t)
        if size > 300_000:
            break
    src = tmp_path_factory.mktemp("src")
    with open(src / "docs.jsonl", "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    out = str(tmp_path_factory.mktemp("corpus") / "c")
    build_corpus([str(src / "docs.jsonl")], out, None, workers=1, demo_vocab_size=512, val_fraction=0.05)
    return out


def write_run(tmp_path, corpus: str, body: str = "", **model) -> str:
    """Write config.json + run.toml for the tiny model; return the TOML path."""
    (tmp_path / "config.json").write_text(json.dumps({**TINY_MODEL, **model}))
    toml = tmp_path / "run.toml"
    toml.write_text(
        '[model]\nconfig = "config.json"\n'
        f'[data]\ncorpus = "{corpus}"\nseq_len = 32\nmicro_batch_size = 2\nglobal_batch_size = 4\n'
        'val_every = 4\nval_batches = 2\n'
        '[optim]\nlr = 3e-3\nwarmup_steps = 2\n'
        f'[log]\nrun_dir = "{tmp_path}/run"\nprogress = false\nplot = false\n'
        '[train]\nthreads = 1\n' + body
    )
    return str(toml)


def run_cli(*args, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run `python -m pithtrain ...` in a fresh process from the source tree."""
    full_env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "pithtrain", *args], capture_output=True, text=True,
                          env=full_env, cwd=ROOT, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"pithtrain {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def losses(run_dir: str) -> dict[int, float]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f)}


def masked_middle_batches(vocab: int, micro: int, seq: int, count: int) -> list[tuple]:
    """`count` micro-batches of random tokens whose labels in the middle half of every sequence
    are ignored (-100): under cp=2 that is all of rank 1's two blocks."""
    import torch

    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        win = torch.randint(0, vocab, (micro, seq + 1), generator=gen)
        labels = win[:, 1:].clone()
        labels[:, seq // 4:3 * seq // 4] = -100
        out.append((win[:, :-1].contiguous(), labels))
    return out
