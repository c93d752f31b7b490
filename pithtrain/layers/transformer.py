"""The decoder layer as five stages, the causal-LM skeleton every model shares, and weight init.

Stages of a decoder layer (the protocol the overlapped pipeline schedule drives):
  1. attention  norm, attention, residual, post-norm, router top-k, shared experts / dense MLP,
                permutation into expert order
  2. dispatch   routed rows to the expert-parallel ranks (local on one rank)
  3. experts    grouped GEMMs and activation on the received rows
  4. combine    expert outputs back to the ranks that sent them (local on one rank)
  5. aggregate  weighted sum over each token's experts, residual
Dense layers do their MLP in stage 1; stages 2-4 pass through. `DecoderLayer.forward` runs the
five in order, so the plain forward and an overlapped schedule compute the same thing.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.checkpoint import checkpoint

from pithtrain.layers.attention import block_masks
from pithtrain.layers.moe import GroupedExperts, MoEBlock, RoutePlan
from pithtrain.layers.norm import RMSNorm
from pithtrain.layers.rope import RotaryEmbedding
from pithtrain.ops.cross_entropy import linear_cross_entropy
from pithtrain.ops.embedding import embedding


@dataclass
class ForwardContext:
    """Per-micro-batch inputs every layer sees."""

    cos: torch.Tensor
    sin: torch.Tensor
    aux_weight: float | None = None  # this rank's weight of the balancing losses (loop.train_step); None: none
    cp: object = None  # parallel.context.ContextGroup when the sequence is split over ranks
    docs: torch.Tensor | None = None  # [B, S] document index of each token (document masking)
    masks: dict | None = None  # FlexAttention block masks by window (CUDA, when a mask is needed)


@dataclass
class LayerState:
    """What one stage hands to the next."""

    residual: torch.Tensor  # hidden state after the attention residual
    partial: torch.Tensor | None = None  # dense MLP or shared-expert output
    rows: torch.Tensor | None = None  # routed rows, in the current stage's layout
    plan: RoutePlan | None = None


class DecoderLayer(nn.Module):
    def __init__(self, attn: nn.Module, mlp: nn.Module, hidden: int, eps: float):
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp  # MoEBlock or a dense MLP
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.is_moe = isinstance(mlp, MoEBlock)
        self.recompute_attention = self.recompute_experts = False  # set by CausalLM.set_recompute

    def attention_block(self, x: torch.Tensor, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """Norm, attention, residual, post-attention norm: (h, normed h). One compiled graph."""
        h = x + self.self_attn(self.input_layernorm(x), ctx)
        return h, self.post_attention_layernorm(h)

    def stage_attention(self, x: torch.Tensor, ctx: ForwardContext) -> LayerState:
        if self.recompute_attention and torch.is_grad_enabled():
            h, y = checkpoint(self.attention_block, x, ctx, use_reentrant=False)
        else:
            h, y = self.attention_block(x, ctx)
        if not self.is_moe:
            return LayerState(h, self.mlp(y))
        shared = self.mlp.shared_experts(y) if self.mlp.shared_experts is not None else None
        rows, plan = self.mlp.route(y, ctx.aux_weight)
        return LayerState(h, shared, rows, plan)

    def stage_dispatch(self, s: LayerState) -> LayerState:
        if self.is_moe:
            s.rows = self.mlp.dispatch(s.rows, s.plan)
        return s

    def stage_experts(self, s: LayerState) -> LayerState:
        if self.is_moe and self.recompute_experts and torch.is_grad_enabled():
            s.rows = checkpoint(self.mlp.compute, s.rows, s.plan, use_reentrant=False)
        elif self.is_moe:
            s.rows = self.mlp.compute(s.rows, s.plan)
        return s

    def stage_combine(self, s: LayerState) -> LayerState:
        if self.is_moe:
            s.rows = self.mlp.combine(s.rows, s.plan)
        return s

    def stage_aggregate(self, s: LayerState) -> torch.Tensor:
        out = s.residual if s.partial is None else s.residual + s.partial
        if self.is_moe:
            out = out + self.mlp.aggregate(s.rows, s.plan)
        return out

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        s = self.stage_attention(x, ctx)
        s = self.stage_combine(self.stage_experts(self.stage_dispatch(s)))
        return self.stage_aggregate(s)


class Embedding(nn.Embedding):
    """The token embedding (HF's `embed_tokens`), its backward by `ops/embedding.py`; called as a
    module, so FSDP gathers its weight as for any layer."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return embedding(ids, self.weight, self.padding_idx)


class Backbone(nn.Module):
    """Embedding, decoder layers (keyed by global layer index) and final norm: HF's `model.*`."""

    def __init__(self, vocab: int, hidden: int, layers: dict[int, DecoderLayer], eps: float,
                 pad_token_id: int | None = None):
        super().__init__()
        self.embed_tokens = Embedding(vocab, hidden, padding_idx=pad_token_id)
        self.layers = nn.ModuleDict({str(i): layer for i, layer in layers.items()})
        self.norm = RMSNorm(hidden, eps)


class LMHead(nn.Linear):
    """The output projection. With labels it returns the summed cross-entropy instead of logits,
    fused with the projection in chunks (`ops/cross_entropy.py`), so no full logits exist; it is
    called as a module either way, so FSDP gathers its weight as for any layer."""

    def forward(self, h: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if labels is None:
            return super().forward(h)
        return linear_cross_entropy(h.flatten(0, -2), self.weight, labels.flatten())


class CausalLM(nn.Module):
    """A decoder-only LM with Hugging Face parameter names (`model.layers.N...`, `lm_head`)."""

    def __init__(self, vocab: int, hidden: int, layers: dict[int, DecoderLayer], rope: RotaryEmbedding,
                 *, eps: float, tie_embeddings: bool, init_std: float, pad_token_id: int | None = None):
        super().__init__()
        if pad_token_id is not None and not -vocab <= pad_token_id < vocab:
            raise ValueError(f"model.pad_token_id = {pad_token_id} lies outside the vocabulary (vocab_size {vocab})")
        self.vocab, self.init_std = vocab, init_std
        self.cp = None  # a parallel.context.ContextGroup: this rank holds two blocks of each sequence
        self.flex = True  # FlexAttention for masked attention on CUDA (False: SDPA with dense masks)
        self.model = Backbone(vocab, hidden, layers, eps, pad_token_id)
        self.rotary_emb = rope
        self.lm_head = LMHead(hidden, vocab, bias=False)
        if tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def compile_dense(self) -> None:
        """torch.compile(fullgraph=True) the dense parts of every layer: the attention block (norm,
        projections, q/k norms, RoPE, SDPA / FlexAttention, residual, post-norm; eager under context
        parallelism, whose ring exchanges blocks between ranks), the router with the sort into
        expert order (`MoEBlock.select`), the dense MLP or shared
        experts, and the final norm. The grouped experts, the permutation and the cross-entropy stay
        eager: they are grouped GEMMs and Triton kernels already. Layers share compiled code
        (parameters are graph inputs); shapes are static, so a run compiles in its first steps and
        then never again (tests/test_compile.py counts)."""
        opts = dict(fullgraph=True, dynamic=False)
        self.model.norm.compile(**opts)
        for layer in self.model.layers.values():
            if self.cp is None:
                layer.attention_block = torch.compile(layer.attention_block, **opts)
            if layer.is_moe:
                layer.mlp.select = torch.compile(layer.mlp.select, **opts)  # router + expert order
                if layer.mlp.shared_experts is not None:
                    layer.mlp.shared_experts.compile(**opts)
            else:
                layer.mlp.compile(**opts)

    def set_recompute(self, attention: bool, experts: bool) -> None:
        """Activation recompute: the attention block and / or the expert computation keep only their
        inputs in forward and run again in backward (less memory, one more forward of the part)."""
        for layer in self.model.layers.values():
            layer.recompute_attention, layer.recompute_experts = attention, experts and layer.is_moe

    def moe_blocks(self) -> list[MoEBlock]:
        return [m for m in self.modules() if isinstance(m, MoEBlock)]

    def parameter_counts(self, count_embedding: bool = True) -> tuple[int, int]:
        """(total, active per token): routed experts count top_k / num_experts of their size.
        `count_embedding=False` leaves the input embedding out of the active count (a lookup, not
        a matmul: the convention of the DeepSeek and GPT-OSS model cards; Qwen counts it)."""
        total = sum(p.numel() for p in self.parameters())
        size = {id(b): sum(p.numel() for p in b.experts.parameters()) for b in self.moe_blocks()}
        active = total - sum(size.values()) + sum(size[id(b)] * b.top_k // b.num_experts for b in self.moe_blocks())
        if not count_embedding and self.lm_head.weight is not self.model.embed_tokens.weight:
            active -= self.model.embed_tokens.weight.numel()
        return total, active

    def context(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None, aux_weight: float | None,
                dtype: torch.dtype, doc_ids: torch.Tensor | None = None) -> ForwardContext:
        B, S = input_ids.shape
        if doc_ids is not None and self.cp is not None:
            raise ValueError("document masking is not supported under context parallelism")
        if position_ids is None:
            if self.cp is not None:
                raise ValueError("under context parallelism the model needs the position_ids of its blocks")
            position_ids = torch.arange(S, device=input_ids.device).expand_as(input_ids)
            if doc_ids is not None:
                position_ids = document_positions(doc_ids)
        cos, sin = self.rotary_emb(position_ids, dtype)
        masks = None
        attns = [layer.self_attn for layer in self.model.layers.values()]
        windows = {getattr(a, "window", None) for a in attns}
        masked = doc_ids is not None or windows != {None} or any(getattr(a, "sinks", None) is not None for a in attns)
        if input_ids.is_cuda and self.flex and self.cp is None and masked:
            masks = block_masks(windows, B, S, doc_ids, input_ids.device)
        return ForwardContext(cos, sin, aux_weight, self.cp, doc_ids, masks)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, aux_weight: float | None = None,
                doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, S, V], or with `labels` the summed cross-entropy over labels != -100.
        `doc_ids` [B, S] (non-decreasing along each sequence) turns on document masking: a token
        attends only within its document, and positions restart at each document's first token."""
        h = self.model.embed_tokens(input_ids)
        dtype = torch.get_autocast_dtype(h.device.type) if torch.is_autocast_enabled(h.device.type) else h.dtype
        ctx = self.context(input_ids, position_ids, aux_weight, dtype, doc_ids)
        for layer in self.model.layers.values():
            h = layer(h, ctx)
        return self.lm_head(self.model.norm(h), labels)


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """Parameters (not buffers: RoPE frequencies and expert counts stay fp32) to `dtype`."""
    for p in model.parameters():
        p.data = p.data.to(dtype)


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """[B, S] document index -> position of each token inside its document (0 at each start)."""
    idx = torch.arange(doc_ids.shape[1], device=doc_ids.device).expand_as(doc_ids)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return idx - torch.cummax(torch.where(starts, idx, 0), dim=1).values


def _seed(seed: int, name: str, expert: int | None = None) -> int:
    key = f"{seed}/{name}" if expert is None else f"{seed}/{name}/expert{expert}"
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") & ((1 << 63) - 1)


@torch.no_grad()
def init_weights(model: CausalLM, seed: int) -> None:
    """Initialise every parameter from (seed, global parameter name[, global expert id]) alone.

    Matrices and embeddings ~ N(0, init_std), norm weights 1, biases 0, aux-free router bias 0. A layout
    that holds only some layers or experts draws exactly the numbers the full model would. Buffers
    (RoPE frequencies, step statistics) are recomputed, so a model made on the meta device and
    allocated with `to_empty` is complete afterwards.
    """
    owners = {}
    for mname, module in model.named_modules():
        for pname, _ in module.named_parameters(recurse=False):
            owners[f"{mname}.{pname}" if mname else pname] = module
    for name, param in model.named_parameters():
        if param.device.type == "meta":
            continue
        module = owners[name]
        # A sharded (FSDP) parameter is drawn whole, one at a time, and keeps its local shard.
        full = torch.empty(param.shape, dtype=param.dtype, device=param.device) if isinstance(param, DTensor) else param
        if isinstance(module, RMSNorm):
            full.fill_(1.0)
        elif name.endswith("bias"):
            full.zero_()
        elif isinstance(module, GroupedExperts):
            for e in range(full.shape[0]):
                gen = torch.Generator(full.device).manual_seed(_seed(seed, name, module.first_expert + e))
                full[e].normal_(0.0, model.init_std, generator=gen)
        else:
            gen = torch.Generator(full.device).manual_seed(_seed(seed, name))
            full.normal_(0.0, model.init_std, generator=gen)
            if isinstance(module, nn.Embedding) and module.padding_idx is not None:
                full[module.padding_idx].zero_()  # as transformers initialises the pad token's row
        if isinstance(param, DTensor):
            local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(local.to_local())
    model.rotary_emb.reset()
    for block in model.moe_blocks():
        block.load.zero_()
        block.aux_total.zero_()
        if block.topk_router.e_score_correction_bias is not None:
            block.topk_router.e_score_correction_bias.zero_()
