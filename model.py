"""A native mixture-of-experts decoder (Qwen3-MoE and GLM-4.5 families) with replayable routing.

One `Transformer` serves training (full causal forward) and cached decoding (a static
KV cache addressed by position, gpt-fast style). Each block is pre-norm attention plus a
dense SwiGLU FFN (the first `first_k_dense_replace` blocks) or a mixture of experts:

- RMSNorm; rotary position embeddings (RoPE, arXiv 2104.09864) on all of each head
  (Qwen3) or its first half (GLM-4.5's partial rotary); grouped-query attention (GQA,
  arXiv 2305.13245) through `kernels.causal_attention` in training (SDPA, or on CPU a
  kernel that stops each query block at its causal frontier) and SDPA with a mask when decoding,
  with optional per-head q/k RMSNorm (Qwen3) and q/k/v bias (GLM-4.5).
- Routers. softmax (Qwen3-MoE): p = softmax(s), top-k of p, weights p_i over the chosen
  set, renormalised to sum 1 when norm_topk_prob: g_i = I_i exp(s_i) / sum_j I_j exp(s_j).
  sigmoid (GLM-4.5, DeepSeek-V3 arXiv 2412.19437 eq. 15-16): p = sigmoid(s); the
  choice uses p + b (b the aux-loss-free expert bias, never in the weights), limited to
  the topk_group best of n_group expert partitions (HF's "groups"); weights p_i, renormalised when
  norm_topk_prob, times routed_scaling_factor. Experts are SwiGLU, run over the
  (token, expert) pairs sorted by expert (`run_experts`) by `kernels.swiglu_experts`
  (two grouped GEMMs, or on CPU one fused pass per expert); an optional shared expert
  sees every token.
- Router replay (R3, arXiv 2510.11370): `forward` can return the expert ids each MoE
  layer chose for every token and can take such ids back: replayed ids replace the
  router's own choice, the weights are recomputed from the live scores at those ids
  (so the router still gets a gradient). A replayed row of -1 (padding) routes freely.

HF checkpoints load and save in the hub's on-disk layout with hf.py's `load_hf` and
`save_hf`. `parallelize` applies expert parallel and FSDP2; it is the only code here
that touches torch.distributed, imported inside it.

Notable choices: the router always runs in fp32 (routing is where precision flips
discrete decisions; HF Qwen3 computes its router logits in the model dtype); RMSNorm
and RoPE follow the HF arithmetic (fp32 inside, fp32 frequency table) so fp32 logits
match HF to float rounding.

Shape legend: B batch, T tokens in this call, S cache length, D model dim, H query heads,
J kv heads, d head dim, r rotary dims, E routed experts, K experts per token, I expert
hidden dim, L MoE layers, V vocabulary, N flattened tokens (B*T), R routed (token, expert)
pairs (N*K), M expert partitions (group-limited routing).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels import causal_attention, combine, gather_rows, swiglu, swiglu_experts


@dataclass
class ModelConfig:
    vocab_size: int = 512
    """Rows of the embedding and lm_head."""
    dim: int = 256
    """Residual stream width D."""
    n_layers: int = 4
    """Decoder blocks."""
    n_heads: int = 8
    """Query heads H."""
    n_kv_heads: int = 2
    """Key/value heads J (GQA); must divide n_heads."""
    head_dim: int = 32
    """Per-head width d."""
    num_experts: int = 16
    """Routed experts E per MoE layer."""
    top_k: int = 4
    """Experts K each token is routed to."""
    moe_inter_dim: int = 256
    """Hidden width I of each routed expert (SwiGLU)."""
    num_shared_experts: int = 0
    """Always-on shared experts, fused into one SwiGLU of width num * moe_inter_dim; 0 = none."""
    first_k_dense_replace: int = 0
    """The first k blocks use a dense SwiGLU FFN instead of experts (GLM-4.5: 1)."""
    dense_inter_dim: int = 0
    """Hidden width of the dense FFN blocks (HF intermediate_size); needed when first_k_dense_replace > 0."""
    router: str = "softmax"
    """'softmax' (Qwen3-MoE) or 'sigmoid' with an expert bias for selection (GLM-4.5, DeepSeek-V3)."""
    norm_topk_prob: bool = True
    """Renormalise the chosen experts' weights to sum to 1."""
    routed_scaling_factor: float = 1.0
    """Multiplies the routed weights (sigmoid router)."""
    n_group: int = 1
    """Expert partitions M of group-limited routing (sigmoid router; HF's key, DeepSeek-V3's "groups")."""
    topk_group: int = 1
    """Expert partitions a token may route into (sigmoid router; HF's key)."""
    qk_norm: bool = False
    """Per-head RMSNorm on queries and keys before RoPE (Qwen3)."""
    attention_bias: bool = False
    """Bias on the q, k, v projections (GLM-4.5)."""
    partial_rotary_factor: float = 1.0
    """Fraction of each head that RoPE rotates (GLM-4.5: 0.5)."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    max_seq_len: int = 1024
    """Longest prompt + completion an engine may cache."""
    tie_embeddings: bool = False
    """Share the embedding matrix with lm_head."""
    init_std: float = 0.02
    """Std of the normal init of every weight matrix (GPT-2's value)."""
    hf_model_type: str = "qwen3_moe"
    """HF model_type `save_hf` writes: 'qwen3_moe' or 'glm4_moe'."""

    def __post_init__(self):
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                     "num_experts", "top_k", "moe_inter_dim", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name}={getattr(self, name)} must be positive")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
        if self.rotary_dim % 2 or self.rotary_dim == 0:
            raise ValueError(f"head_dim * partial_rotary_factor = {self.rotary_dim} must be even and positive")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.router not in ("softmax", "sigmoid"):
            raise ValueError(f"router={self.router!r}; valid: 'softmax', 'sigmoid'")
        if self.num_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"n_group={self.n_group} must divide num_experts={self.num_experts} and "
                             f"1 <= topk_group={self.topk_group} <= n_group")
        if not 0 <= self.first_k_dense_replace <= self.n_layers:
            raise ValueError(f"first_k_dense_replace={self.first_k_dense_replace} must be in [0, n_layers={self.n_layers}]")
        if self.first_k_dense_replace and self.dense_inter_dim <= 0:
            raise ValueError("dense_inter_dim must be positive when first_k_dense_replace > 0")
        if self.hf_model_type not in HF_FAMILIES:
            raise ValueError(f"hf_model_type={self.hf_model_type!r}; valid: {sorted(HF_FAMILIES)}")

    @property
    def num_moe_layers(self) -> int:
        return self.n_layers - self.first_k_dense_replace

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_hf(cls, config: str | dict) -> ModelConfig:
        """From an HF config.json (path or dict) of model_type qwen3_moe or glm4_moe.

        Raises ValueError on another model_type or a feature this model lacks.
        """
        if isinstance(config, str):
            with open(config) as f:
                config = json.load(f)
        c = dict(config)
        kind = c.get("model_type")
        if kind not in HF_FAMILIES:
            raise ValueError(f"model_type={kind!r} is not supported; valid: {sorted(HF_FAMILIES)}")
        rope = c.get("rope_parameters") or {}
        common = dict(
            vocab_size=c["vocab_size"], dim=c["hidden_size"], n_layers=c["num_hidden_layers"],
            n_heads=c["num_attention_heads"], n_kv_heads=c["num_key_value_heads"],
            head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
            top_k=c["num_experts_per_tok"], moe_inter_dim=c["moe_intermediate_size"],
            dense_inter_dim=c["intermediate_size"], norm_topk_prob=c.get("norm_topk_prob", True),
            attention_bias=c.get("attention_bias", False), rope_theta=rope.get("rope_theta", c.get("rope_theta", 10000.0)),
            norm_eps=c["rms_norm_eps"], max_seq_len=c.get("max_position_embeddings", 4096),
            tie_embeddings=c.get("tie_word_embeddings", False), hf_model_type=kind)
        if kind == "qwen3_moe":
            if c.get("decoder_sparse_step", 1) != 1 or c.get("mlp_only_layers"):
                raise ValueError("qwen3_moe with decoder_sparse_step != 1 or mlp_only_layers is not supported")
            if c.get("use_sliding_window"):
                raise ValueError("qwen3_moe with use_sliding_window is not supported")
            return cls(**common, num_experts=c.get("num_experts", c.get("num_local_experts")), qk_norm=True, router="softmax")
        return cls(**common, num_experts=c["n_routed_experts"], num_shared_experts=c.get("n_shared_experts", 0),
                   first_k_dense_replace=c.get("first_k_dense_replace", 0), router="sigmoid",
                   routed_scaling_factor=c.get("routed_scaling_factor", 1.0), n_group=c.get("n_group", 1),
                   topk_group=c.get("topk_group", 1), qk_norm=c.get("use_qk_norm", False),
                   partial_rotary_factor=rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 0.5)))

    def to_hf(self) -> dict:
        """The HF config.json of this model (inverse of from_hf)."""
        c = dict(model_type=self.hf_model_type, architectures=[HF_FAMILIES[self.hf_model_type]],
                 vocab_size=self.vocab_size, hidden_size=self.dim, num_hidden_layers=self.n_layers,
                 num_attention_heads=self.n_heads, num_key_value_heads=self.n_kv_heads, head_dim=self.head_dim,
                 num_experts_per_tok=self.top_k, moe_intermediate_size=self.moe_inter_dim,
                 intermediate_size=self.dense_inter_dim or self.moe_inter_dim, norm_topk_prob=self.norm_topk_prob,
                 attention_bias=self.attention_bias, rms_norm_eps=self.norm_eps,
                 max_position_embeddings=self.max_seq_len, tie_word_embeddings=self.tie_embeddings,
                 hidden_act="silu", torch_dtype="float32",
                 rope_parameters=dict(rope_type="default", rope_theta=self.rope_theta,
                                      partial_rotary_factor=self.partial_rotary_factor))
        if self.hf_model_type == "qwen3_moe":
            if self.router != "softmax" or self.first_k_dense_replace or self.num_shared_experts or not self.qk_norm:
                raise ValueError("qwen3_moe needs router='softmax', qk_norm, no dense layers and no shared experts")
            c.update(num_experts=self.num_experts, decoder_sparse_step=1, mlp_only_layers=[])
        else:
            if self.router != "sigmoid":
                raise ValueError("glm4_moe needs router='sigmoid'")
            c.update(n_routed_experts=self.num_experts, n_shared_experts=self.num_shared_experts,
                     first_k_dense_replace=self.first_k_dense_replace, routed_scaling_factor=self.routed_scaling_factor,
                     n_group=self.n_group, topk_group=self.topk_group, use_qk_norm=self.qk_norm, num_nextn_predict_layers=0)
        return c


HF_FAMILIES = {"qwen3_moe": "Qwen3MoeForCausalLM", "glm4_moe": "Glm4MoeForCausalLM"}


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps), normalised in fp32 and cast back before the weight (HF order)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


def rope(pos_BT: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [B, T, r] fp32 (arXiv 2104.09864 eq. 34; frequencies in fp32 as HF computes them)."""
    r = cfg.rotary_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, r, 2, dtype=torch.float, device=pos_BT.device) / r))
    freqs = pos_BT[..., None].float() * inv_freq  # (B, T, r/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (B, T, r)
    return emb.cos(), emb.sin()


def apply_rope(x_BHTd: torch.Tensor, cos_BTr: torch.Tensor, sin_BTr: torch.Tensor) -> torch.Tensor:
    """Rotate the first r dims of each head by halves (HF "rotate_half" layout); the rest pass."""
    r = cos_BTr.shape[-1]
    rot, rest = x_BHTd[..., :r], x_BHTd[..., r:]
    x1, x2 = rot.chunk(2, dim=-1)
    cos, sin = cos_BTr[:, None].to(x_BHTd.dtype), sin_BTr[:, None].to(x_BHTd.dtype)  # (B, 1, T, r)
    rotated = rot * cos + torch.cat([-x2, x1], dim=-1) * sin
    return torch.cat([rotated, rest], dim=-1) if rest.shape[-1] else rotated


class KVCache:
    """Static per-layer key/value cache [B, J, S, d], addressed by absolute column."""

    def __init__(self, cfg: ModelConfig, batch_size: int, max_len: int, *, dtype, device):
        shape = (cfg.n_layers, batch_size, cfg.n_kv_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def update(self, layer: int, start: int, k_BJTd, v_BJTd):
        """Write this call's keys/values at columns [start, start+T); return all columns so far."""
        end = start + k_BJTd.shape[2]
        self.k[layer, :, :, start:end] = k_BJTd
        self.v[layer, :, :, start:end] = v_BJTd
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        H, J, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wqkv = nn.Linear(cfg.dim, (H + 2 * J) * d, bias=cfg.attention_bias)  # q, k, v fused: one GEMM
        self.wo = nn.Linear(H * d, cfg.dim, bias=False)
        self.q_norm = RMSNorm(d, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.norm_eps) if cfg.qk_norm else None

    def forward(self, x_BTD, cos, sin, cache: KVCache | None, cache_start: int, mask_B1TS):
        B, T, _ = x_BTD.shape
        cfg = self.cfg
        qkv = self.wqkv(x_BTD).view(B, T, cfg.n_heads + 2 * cfg.n_kv_heads, cfg.head_dim)  # (B, T, H+2J, d)
        q, k, v = qkv.split([cfg.n_heads, cfg.n_kv_heads, cfg.n_kv_heads], dim=2)  # (B, T, H|J|J, d)
        v = v.transpose(1, 2)  # (B, J, T, d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin)  # (B, H|J, T, d)
        if cache is not None:
            k, v = cache.update(self.layer, cache_start, k, v)  # (B, J, S, d)
        if cache is None and mask_B1TS is None:  # training: plain causal over this call's tokens
            y = causal_attention(q, k, v)  # (B, H, T, d)
        else:  # cached decoding, or an explicit mask
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_B1TS, is_causal=mask_B1TS is None,
                                               enable_gqa=cfg.n_heads != cfg.n_kv_heads)  # (B, H, T, d)
        return self.wo(y.transpose(1, 2).reshape(B, T, cfg.n_heads * cfg.head_dim))


class FeedForward(nn.Module):
    """SwiGLU FFN w2(silu(w1 x) * w3 x), with w1 and w3 fused into one matrix w13 (one GEMM, not two)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w13 = nn.Linear(dim, 2 * hidden, bias=False)  # [gate; up] rows
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(swiglu(self.w13(x)))


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by `scale` on the way back."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None


class GroupedExperts(nn.Module):
    """E SwiGLU experts stacked for grouped GEMMs: w13 [E, D, 2I] (gate | up), w2 [E, I, D]."""

    def __init__(self, num_experts: int, dim: int, hidden: int):
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(num_experts, dim, 2 * hidden))  # gate and up projections, fused
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, dim))  # down projection

    grad_scale = 1.0  # set by parallelize: expert gradients under EP are divided by ep

    def forward(self, x_RD: torch.Tensor, counts_e: torch.Tensor) -> torch.Tensor:
        """Rows grouped by local expert (counts_e rows each) -> expert outputs, same order."""
        w13, w2 = (w.to_local() if hasattr(w, "to_local") else w for w in (self.w13, self.w2))
        if self.grad_scale != 1.0:
            w13, w2 = _ScaleGrad.apply(w13, self.grad_scale), _ScaleGrad.apply(w2, self.grad_scale)
        return swiglu_experts(x_RD, w13, w2, counts_e)  # (R, D)


def run_experts(experts: nn.Module, x_ND: torch.Tensor, ids_NK: torch.Tensor, weights_NK: torch.Tensor) -> torch.Tensor:
    """Weighted sum over each token's K routed experts [N, D], in x's dtype (all experts local).

    The N*K (token, expert) pairs are sorted by expert, so two grouped GEMMs run over exactly
    the routed rows (no capacity padding), then permuted back to (token, k) order and summed
    with the gate weights in fp32. Sorting and its inverse are permutations, so no row is
    scatter-added in either direction; no host sync (shapes never depend on the routes).
    """
    N, K = ids_NK.shape
    pair_R = ids_NK.flatten()
    counts_E = pair_R.new_zeros(experts.w13.shape[0]).scatter_add_(0, pair_R, torch.ones_like(pair_R))  # bincount syncs on CUDA
    order_R = pair_R.argsort(stable=True)  # (N*K,) pair ids n*K + k, grouped by expert
    inverse_R = torch.empty_like(order_R).scatter_(0, order_R, torch.arange(N * K, device=order_R.device))
    out_RD = experts(gather_rows(x_ND, order_R // K, inverse_R, K), counts_E)  # (N*K, D) by expert
    return combine(out_RD, inverse_R, order_R, weights_NK).to(x_ND.dtype)  # (N, D), weighted in fp32


class MoE(nn.Module):
    """Routed top-k SwiGLU experts plus an optional shared expert."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.gate = nn.Linear(cfg.dim, cfg.num_experts, bias=False)  # router
        # aux-loss-free selection bias (sigmoid router); loaded, never trained by gradient
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts), persistent=cfg.router == "sigmoid")
        self.experts = GroupedExperts(cfg.num_experts, cfg.dim, cfg.moe_inter_dim)
        self.shared = FeedForward(cfg.dim, cfg.num_shared_experts * cfg.moe_inter_dim) if cfg.num_shared_experts else None
        self.dispatcher = None  # expert-parallel token dispatch, set by parallelize()

    def route(self, x_ND: torch.Tensor, replay_NK: torch.Tensor | None):
        """Expert ids [N, K] int64 and gate weights [N, K] fp32 (R3: replayed ids, live scores)."""
        cfg = self.cfg
        logits_NE = F.linear(x_ND.float(), self.gate.weight.float())
        if cfg.router == "softmax":
            scores_NE = logits_NE.softmax(dim=-1)
            choice_NE = scores_NE
        else:
            scores_NE = logits_NE.sigmoid()
            choice_NE = scores_NE + self.expert_bias.float()
            if cfg.n_group > 1:  # group-limited routing: only the topk_group partitions whose best two experts score highest
                N, E = choice_NE.shape
                M = cfg.n_group  # expert partitions of E / M consecutive experts each
                part_NM = choice_NE.view(N, M, E // M).topk(2, dim=-1).values.sum(-1)
                keep_NM = torch.zeros_like(part_NM).scatter_(1, part_NM.topk(cfg.topk_group, dim=-1).indices, 1.0)
                keep_NE = keep_NM[:, :, None].expand(N, M, E // M).reshape(N, E)
                choice_NE = choice_NE.masked_fill(keep_NE == 0, float("-inf"))
        own_NK = choice_NE.topk(cfg.top_k, dim=-1).indices
        if replay_NK is None:
            ids_NK = own_NK
        else:
            pad_N1 = (replay_NK < 0).all(dim=-1, keepdim=True)  # padding rows route as the router would
            ids_NK = torch.where(pad_N1, own_NK, replay_NK.long())
        weights_NK = scores_NE.gather(-1, ids_NK)
        if cfg.norm_topk_prob:
            # the sigmoid router's epsilon is HF GLM-4.5's; softmax scores always sum above zero
            weights_NK = weights_NK / (weights_NK.sum(-1, keepdim=True) + (1e-20 if cfg.router == "sigmoid" else 0.0))
        return ids_NK, weights_NK * cfg.routed_scaling_factor

    def forward(self, x_BTD: torch.Tensor, replay_BTK: torch.Tensor | None):
        B, T, D = x_BTD.shape
        K, E = self.cfg.top_k, self.cfg.num_experts
        x_ND = x_BTD.reshape(B * T, D)
        ids_NK, weights_NK = self.route(x_ND, None if replay_BTK is None else replay_BTK.reshape(B * T, K))
        if self.dispatcher is not None:  # expert parallel: all-to-all to the ranks that own the experts
            counts_E = torch.bincount(ids_NK.flatten(), minlength=E)
            x_RD, counts_e, meta = self.dispatcher.dispatch(x_ND, weights_NK, ids_NK, counts_E)
            y_ND = self.dispatcher.combine(self.experts(x_RD, counts_e), meta, x_ND)
        else:
            y_ND = run_experts(self.experts, x_ND, ids_NK, weights_NK)
        if self.shared is not None:
            y_ND = y_ND + self.shared(x_ND)
        return y_ND.view(B, T, D), ids_NK.view(B, T, K)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg, layer)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.is_moe = layer >= cfg.first_k_dense_replace
        self.mlp = MoE(cfg) if self.is_moe else FeedForward(cfg.dim, cfg.dense_inter_dim)

    def forward(self, x_BTD, cos, sin, cache, cache_start, mask, replay_BTK):
        x_BTD = x_BTD + self.attn(self.attn_norm(x_BTD), cos, sin, cache, cache_start, mask)
        if not self.is_moe:
            return x_BTD + self.mlp(self.ffn_norm(x_BTD)), None
        y_BTD, ids_BTK = self.mlp(self.ffn_norm(x_BTD), replay_BTK)
        return x_BTD + y_BTD, ids_BTK


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        if not any(p.is_meta for p in self.parameters()):
            self.init_weights()

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None):
        """Normal(0, init_std) matrices, residual-branch outputs scaled by 1/sqrt(2 n_layers)
        (GPT-2, Radford et al. 2019); norms 1; biases and the expert bias 0."""
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif p.dim() == 1:
                p.zero_()
            else:
                out_proj = name.endswith(("wo.weight", "w2", "w2.weight"))
                p.normal_(0.0, std / math.sqrt(2 * self.cfg.n_layers) if out_proj else std, generator=generator)
        for name, b in self.named_buffers():
            if name.endswith("expert_bias"):
                b.zero_()

    def hidden(self, tokens_BT: torch.Tensor, *, pos_BT: torch.Tensor | None = None,
               routed_experts: torch.Tensor | None = None, return_routes: bool = False,
               cache: KVCache | None = None, cache_start: int = 0, mask_B1TS: torch.Tensor | None = None):
        """Final-norm hidden states [B, T, D] and, if return_routes, ids [B, T, L, K] (else None).

        Arguments as in `forward`.
        """
        B, T = tokens_BT.shape
        if routed_experts is not None:
            check_routes(routed_experts, (B, T, self.cfg.num_moe_layers, self.cfg.top_k), self.cfg.num_experts)
        if pos_BT is None:
            pos_BT = torch.arange(T, device=tokens_BT.device).expand(B, T)
        cos, sin = rope(pos_BT, self.cfg)
        x = self.embed(tokens_BT)
        routes, moe_i = [], 0
        for layer in self.layers:
            replay = None
            if layer.is_moe and routed_experts is not None:
                replay = routed_experts[:, :, moe_i]
            x, ids_BTK = layer(x, cos, sin, cache, cache_start, mask_B1TS, replay)
            if layer.is_moe:
                routes.append(ids_BTK)
                moe_i += 1
        return self.norm(x), (torch.stack(routes, dim=2) if return_routes and routes else None)

    def forward(self, tokens_BT: torch.Tensor, **kwargs):
        """Logits [B, T, V] fp32 and, if `return_routes`, expert ids [B, T, L, K] int64 (else None).

        tokens_BT: int64 token ids. pos_BT: RoPE positions (default 0..T-1 per row).
        routed_experts: int [B, T, L, K] ids to replay (R3, arXiv 2510.11370), L = MoE
        layers only; rows of -1 route freely.
        cache / cache_start / mask_B1TS: cached decoding; keys and values of this call are
        written at cache columns [cache_start, cache_start+T); mask_B1TS (bool, True = attend)
        covers all S = cache_start+T columns. Without a mask attention is causal.
        Raises ValueError on a wrong replay shape, an expert id outside [-1, E), a row that
        mixes -1 with ids, or a row that repeats an expert.
        """
        h, routes = self.hidden(tokens_BT, **kwargs)
        return self.lm_head(h).float(), routes


def check_routes(routed_experts: torch.Tensor, want: tuple, num_experts: int):
    """Validate replayed expert ids; raises ValueError naming what is wrong."""
    if tuple(routed_experts.shape) != want:
        raise ValueError(f"routed_experts has shape {tuple(routed_experts.shape)}, expected {want} (B, T, L, K)")
    lo, hi = int(routed_experts.min()), int(routed_experts.max())
    if lo < -1 or hi >= num_experts:
        raise ValueError(f"routed_experts ids span [{lo}, {hi}]; valid ids are -1 (padding) and [0, {num_experts})")
    pad = routed_experts < 0
    if bool((pad.any(-1) & ~pad.all(-1)).any()):
        raise ValueError("routed_experts has a row mixing -1 and expert ids; a padding row must be all -1")
    ids = routed_experts.sort(dim=-1).values
    if bool(((ids[..., 1:] == ids[..., :-1]) & (ids[..., 1:] >= 0)).any()):
        raise ValueError("routed_experts repeats an expert within a token's top-k; ids in a row must be distinct")


def token_logprobs(logits_BTV: torch.Tensor, targets_BT: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log pi(target) [B, T] fp32 under softmax(logits / temperature)."""
    logp = (logits_BTV.float() / temperature).log_softmax(dim=-1)
    return logp.gather(-1, targets_BT.unsqueeze(-1)).squeeze(-1)


def token_entropy(logits_BTV: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Full-vocabulary entropy -sum_v p log p [B, T] fp32, in nats."""
    logp = (logits_BTV.float() / temperature).log_softmax(dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


# ----------------------------------------------------------------------------- parallelism

def checkpoint_and_compile(model: Transformer, *, activation_checkpoint: bool, compile: bool) -> Transformer:
    """Per block, in place: activation checkpointing (its activations recomputed in backward), then
    torch.compile. `parallelize`'s steps 2 and 3; a one-process run takes just these."""
    if activation_checkpoint:
        # torch's wrapper lives under torch.distributed but is plain autograd: no process group needed
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        for i, block in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(block)
    if compile:
        for block in model.layers:
            block.compile()
    return model


def parallelize(model: Transformer, dims, *, param_dtype: torch.dtype | None = torch.bfloat16,
                reduce_dtype: torch.dtype | None = torch.float32, activation_checkpoint: bool = False,
                compile: bool = False) -> Transformer:
    """Shard a (meta-device or materialised) model over torchtitan `ParallelDims` meshes, in place.

    Order, as torchtitan applies it: 1. expert parallel: each MoE layer's stacked experts
    become DTensors sharded on the expert dim over the `ep` mesh, and tokens reach them
    through torchtitan's `AllToAllTokenDispatcher`; 2. activation checkpointing per
    block; 3. torch.compile per block; 4. FSDP2 `fully_shard` per block and at the root
    over the `fsdp` mesh (params in param_dtype, gradients reduced in reduce_dtype),
    the experts over the `efsdp` mesh. Expert gradients sum the tokens of all EP ranks,
    so they are divided by ep to stay the data-parallel mean the dense gradients are.
    Afterwards `model.local_offsets` maps each sharded parameter to the global offset of
    this rank's slice (what `load_hf` reads).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    moe_blocks = [b for b in model.layers if b.is_moe]
    if dims.ep > 1:
        from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher
        ep_mesh = dims.get_mesh("ep")
        if model.cfg.num_experts % dims.ep:
            raise ValueError(f"num_experts={model.cfg.num_experts} must be divisible by ep={dims.ep}")
        for block in moe_blocks:
            experts = block.mlp.experts
            for name, p in list(experts.named_parameters()):
                experts.register_parameter(name, nn.Parameter(distribute_tensor(p.data, ep_mesh, [Shard(0)])))
            dispatcher = AllToAllTokenDispatcher(AllToAllTokenDispatcher.Config(
                num_experts=model.cfg.num_experts, top_k=model.cfg.top_k))
            dispatcher.wire_meshes(ep_mesh=ep_mesh)
            block.mlp.dispatcher = dispatcher
    checkpoint_and_compile(model, activation_checkpoint=activation_checkpoint, compile=compile)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    fsdp_mesh, efsdp = dims.get_mesh("fsdp"), dims.dp_shard * dims.cp * dims.tp // dims.ep
    ignored = set()  # EP-only experts (efsdp == 1): kept out of FSDP, gradients divided by ep in forward
    for block in model.layers:
        inner = getattr(block, "_checkpoint_wrapped_module", block)
        if inner.is_moe and dims.ep > 1:
            experts = inner.mlp.experts
            if efsdp > 1:
                fully_shard(experts, mesh=dims.get_mesh("efsdp"), mp_policy=mp)
                experts.set_gradient_divide_factor(efsdp * dims.ep)
            else:
                experts.grad_scale = 1.0 / dims.ep
                ignored.update(experts.parameters())
        fully_shard(block, mesh=fsdp_mesh, mp_policy=mp, ignored_params=ignored or None)
    fully_shard(model, mesh=fsdp_mesh, mp_policy=mp, ignored_params=ignored or None)
    model.local_offsets = {
        unwrapped(name): compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)[1]
        for name, p in model.named_parameters() if isinstance(p, DTensor)}
    return model


CHECKPOINT_WRAPPER = "._checkpoint_wrapped_module"  # what activation checkpointing inserts into parameter names


def unwrapped(name: str) -> str:
    """A parameter's name as the unwrapped model has it (state dicts, HF names, engines use these)."""
    return name.replace(CHECKPOINT_WRAPPER, "")


def policy_tensors(model: Transformer) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter (a tied lm_head once, as the embedding) and persistent buffer (GLM-4.5's
    expert_bias), detached, under the unwrapped model's names: what an engine, a checkpoint or an
    HF export needs. Sharded parameters come as their local DTensors (see `full_tensor`)."""
    persistent = set(model.state_dict(keep_vars=True))  # state_dict already drops the wrapper from names
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if unwrapped(name) in persistent:
            yield unwrapped(name), t.detach()


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor shard (a collective: every rank of its mesh must call it), else t, detached."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()
