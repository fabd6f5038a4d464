"""The policy network: a native mixture-of-experts decoder (Qwen3-MoE, GLM-4.5) with replayable routing.

One `Transformer` serves training (a full causal forward) and cached decoding (a static KV
cache addressed by position, gpt-fast style; rollout.py's engine drives decoding over these
modules). This file owns `ModelConfig` (hf_config.py maps it to and from HF's config.json), the
blocks, the two routers and the experts, and router replay; the per-token logprobs and entropy a
trainer's forward returns are computed from the hidden states in chunks by logprobs.py, and the
tensor ops its modules call (RoPE's rotation, the attention calls, SwiGLU, the grouped GEMMs, the row
gather) are ops.py's. It imports nothing from torch.distributed: the sharding (expert parallel +
FSDP2, `parallelize`) is distributed.py's, applied from outside as torchtitan does. hf.py moves the
weights in and out of HF checkpoints.
Shapes: B, T, S, D, H, J, d, r, V, N, E, K, I, L, R, M (letters of the README's legend).

Papers: RMSNorm (arXiv 1910.07467), RoPE (arXiv 2104.09864), GQA (arXiv 2305.13245), SwiGLU
(arXiv 2002.05202); the Qwen3-MoE softmax router (arXiv 2505.09388); the GLM-4.5 sigmoid
router (arXiv 2508.06471) as DeepSeek-V3 defines it (arXiv 2412.19437 eq. 12-16), with the
auxiliary-loss-free expert bias (arXiv 2408.15664); router replay, R3 (arXiv 2510.11370).

What it computes:
1. Blocks: pre-norm attention, then a dense SwiGLU FFN (the first `first_k_dense_replace`
   blocks, GLM-4.5) or a mixture of experts. RoPE on all of each head (Qwen3) or its first r
   dims (GLM-4.5's partial rotary); GQA through SDPA, causal in training and with a mask for
   the engine's prefill (its decode step is rollout.decode_step); optional per-head q/k
   RMSNorm (Qwen3) and q/k/v bias (GLM-4.5; and o, Qwen3-MoE's); RoPE frequencies default,
   linear or YaRN's (arXiv 2309.00071), as transformers computes them (`rope_frequencies`).
2. Softmax router (Qwen3-MoE): p = softmax(s), top-k of p, weights p_i over the chosen set,
   renormalised to sum 1 when norm_topk_prob: g_i = exp(s_i) / sum_{j in top-k} exp(s_j), i in top-k.
3. Sigmoid router (GLM-4.5; DeepSeek-V3 eq. 15-16): p = sigmoid(s); the choice uses p + b
   (b the expert bias, never in the weights), limited to the topk_group best of n_group
   expert partitions (DeepSeek-V3's node-limited routing); weights p_i, renormalised when
   norm_topk_prob (eq. 13), times routed_scaling_factor (HF's, not in the paper's equations).
4. Experts: SwiGLU, run over the (token, expert) pairs sorted by expert (`run_experts`): two
   grouped GEMMs (`ops.grouped_mm`: `torch._grouped_mm`) around the SwiGLU, then each token's K outputs
   gathered back and weighted; an optional shared expert sees every token (eq. 12).
5. Router replay (R3): `forward` can return the expert ids each MoE layer chose for every
   token and can take such ids back: replayed ids replace the router's own choice, and the
   weights are recomputed from the live scores at those ids (so the router still gets a
   gradient). A replayed row of -1 (padding) routes freely.

Notable choices and departures:
1. The router always computes in fp32 (input and weight upcast): routing is where precision
   flips discrete decisions (HF Qwen3 computes its router logits in the model dtype). Under
   bf16 mixed precision `parallelize` keeps the gate's weight in fp32 too.
2. RMSNorm and RoPE follow HF's arithmetic (fp32 inside, an fp32 frequency table, cos and
   sin cast to the activation dtype), so fp32 logits match HF's to float rounding.
3. The gate weights stay fp32 through `run_experts`' weighted sum of the expert outputs (HF
   Qwen3 casts them to the model dtype first; so does torchtitan's combine under EP).
4. The expert bias is loaded and frozen: nothing in this repository applies DeepSeek-V3's
   load-based update of b (arXiv 2408.15664); RL keeps the pre-trained bias.
5. Init: normal(0, init_std) matrices, the residual-branch outputs scaled by 1/sqrt(2 n_layers)
   (GPT-2), so the residual stream's variance does not grow with depth.
6. On CUDA attention runs only on SDPA's fused kernels (flash, memory-efficient, cuDNN): a call that
   only the math kernel (O(T^2) memory) would take raises instead (`ops.fused_attention`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from logprobs import chunked_logprobs
from ops import apply_rope, fused_attention, gather_rows, grouped_mm, single_query_attention, swiglu
from rules import FLAG, POSITIVE, check_fields, integer, number, one_of


HF_MODEL_TYPES = ("qwen3_moe", "glm4_moe")
"""The HF families this model implements (hf.py maps config.json to and from ModelConfig)."""


@dataclass
class ModelConfig:
    vocab_size: int = 512
    """Rows of the embedding and lm_head."""
    dim: int = 256
    """Residual stream width D."""
    n_layers: int = 4
    """Decoder blocks, dense and MoE."""
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
    """Expert partitions M of partition-limited routing (sigmoid router; HF's key; DeepSeek-V3's nodes)."""
    topk_group: int = 1
    """Expert partitions a token may route into (sigmoid router; HF's key)."""
    qk_norm: bool = True
    """Per-head RMSNorm on queries and keys before RoPE (Qwen3-MoE always; GLM-4.5's use_qk_norm, off in
    GLM-4.5-Air). On by default: a default model is a Qwen3-MoE, which a checkpoint must be able to express."""
    attention_bias: bool = False
    """Bias on the q, k, v projections (GLM-4.5; Qwen3-MoE's attention_bias sets attention_out_bias too)."""
    attention_out_bias: bool = False
    """Bias on the output projection wo (Qwen3-MoE's attention_bias: q, k, v and o)."""
    partial_rotary_factor: float = 1.0
    """Fraction of each head that RoPE rotates (GLM-4.5: 0.5)."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    rope_type: str = "default"
    """'default', 'linear' (frequencies / rope_factor) or 'yarn' (arXiv 2309.00071), as transformers 5.24 has them."""
    rope_factor: float = 1.0
    """Context extension factor s of 'linear' and 'yarn'."""
    rope_original_max_seq_len: int = 0
    """'yarn': the pre-training context L its ramp is measured over (HF original_max_position_embeddings)."""
    yarn_beta_fast: float = 32.0
    """'yarn': a frequency turning more than this many times over L is kept as it is (HF beta_fast)."""
    yarn_beta_slow: float = 1.0
    """'yarn': a frequency turning fewer than this many times over L is divided by s (HF beta_slow)."""
    yarn_truncate: bool = True
    """'yarn': round the ramp's ends out to whole dims (HF truncate)."""
    rope_attention_factor: float = 0.0
    """'yarn': the scale of cos and sin (attention logits scale by its square); 0 = YaRN's 0.1 ln(s) + 1."""
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

    RULES = {  # each field's type and range (rules.py); not a field: no annotation
        **{k: integer(1) for k in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "num_experts",
                                   "top_k", "moe_inter_dim", "n_group", "topk_group", "max_seq_len")},
        **{k: integer(0) for k in ("num_shared_experts", "first_k_dense_replace", "dense_inter_dim",
                                   "rope_original_max_seq_len")},
        **{k: FLAG for k in ("norm_topk_prob", "qk_norm", "attention_bias", "attention_out_bias", "yarn_truncate",
                             "tie_embeddings")},
        **{k: POSITIVE for k in ("routed_scaling_factor", "rope_theta", "rope_factor", "yarn_beta_fast",
                                 "yarn_beta_slow", "norm_eps", "init_std")},
        "router": one_of("softmax", "sigmoid"),
        "partial_rotary_factor": number(0, 1, low_open=True),
        "rope_type": one_of("default", "linear", "yarn"),  # rope_frequencies' types
        "rope_attention_factor": number(0, why="0 = YaRN's 0.1 ln(s) + 1"),
        "hf_model_type": one_of(*HF_MODEL_TYPES),
    }

    def __post_init__(self):
        """Each field against its rule (`RULES`), then the relations between them. Raises ValueError naming them."""
        check_fields(self)
        # GQA: each kv head serves H / J query heads
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
        # RoPE rotates dim i with dim i + r/2, so r must be even
        if self.rotary_dim % 2 or self.rotary_dim == 0:
            raise ValueError(f"head_dim * partial_rotary_factor = {self.rotary_dim} must be even and positive")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.top_k == 1 and self.norm_topk_prob:
            # one weight renormalised over one expert is exactly 1: the router's scores never reach the loss
            raise ValueError("top_k=1 with norm_topk_prob=True gives every token a gate weight of exactly 1, so the "
                             "router gets no gradient; set norm_topk_prob=False or top_k >= 2")
        # YaRN's ramp is measured over the pre-training length L
        if self.rope_type == "yarn" and self.rope_original_max_seq_len <= 0:
            raise ValueError(f"rope_type='yarn' needs rope_original_max_seq_len > 0 (the pre-training context), "
                             f"got {self.rope_original_max_seq_len}")
        # a partition is E / M consecutive experts, so M must divide E
        if self.num_experts % self.n_group or self.topk_group > self.n_group:
            raise ValueError(f"n_group={self.n_group} must divide num_experts={self.num_experts} and "
                             f"1 <= topk_group={self.topk_group} <= n_group")
        if self.first_k_dense_replace > self.n_layers:
            raise ValueError(f"first_k_dense_replace={self.first_k_dense_replace} must be in [0, n_layers={self.n_layers}]")
        if self.first_k_dense_replace and self.dense_inter_dim <= 0:
            raise ValueError("dense_inter_dim must be positive when first_k_dense_replace > 0")

    @property
    def num_moe_layers(self) -> int:
        """L: the blocks after the dense ones."""
        return self.n_layers - self.first_k_dense_replace

    @property
    def rotary_dim(self) -> int:
        """r: the leading dims of each head that RoPE rotates."""
        return int(self.head_dim * self.partial_rotary_factor)



class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps) (arXiv 1910.07467), normalised in fp32 and cast back before the weight
    (HF order)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # the cast back comes before the weight, as in HF: in bf16 the product then rounds as HF's does
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


def rope(pos_BT: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [B, T, r] fp32 (arXiv 2104.09864 eq. 34), times `rope_frequencies`' scale (1 but for YaRN)."""
    inv_freq, scale = rope_frequencies(cfg, pos_BT.device)  # (r/2,)
    freqs = pos_BT[..., None].float() * inv_freq  # (B, T, r/2)
    # each frequency twice: HF's rotate_half layout pairs dim i with dim i + r/2
    emb = torch.cat([freqs, freqs], dim=-1)  # (B, T, r)
    if scale == 1.0:
        return emb.cos(), emb.sin()
    return emb.cos() * scale, emb.sin() * scale  # in fp32, before apply_rope's cast, as HF scales them


def rope_frequencies(cfg: ModelConfig, device) -> tuple[torch.Tensor, float]:
    """theta_i [r/2] fp32 and the cos/sin scale of cfg.rope_type, in transformers 5.24's operations and order
    (modeling_rope_utils), so to the last bit. 'default': theta_i = base^(-2i / r); 'linear': theta_i / s;
    'yarn' (arXiv 2309.00071): theta_i / s on the dims turning under beta_slow times over L, theta_i on those
    over beta_fast, a linear ramp between (section 3.2); cos and sin times rope_attention_factor or, unset,
    YaRN's sqrt(1/t) = 0.1 ln(s) + 1 (section 3.4)."""
    r = cfg.rotary_dim
    # fp32 even for bf16 models, where pos * theta_i would lose the fractional radians that distinguish
    # neighbouring positions
    pos_freqs = cfg.rope_theta ** (torch.arange(0, r, 2, dtype=torch.float, device=device) / r)  # base^(2i / r)
    inv_freq = 1.0 / pos_freqs
    if cfg.rope_type != "yarn":
        return (inv_freq / cfg.rope_factor if cfg.rope_type == "linear" else inv_freq), 1.0
    L, s = cfg.rope_original_max_seq_len, cfg.rope_factor
    # the (fractional) dim whose frequency turns `rot` times over L; the ramp runs from low to high
    low, high = ((r * math.log(L / (rot * 2 * math.pi))) / (2 * math.log(cfg.rope_theta))
                 for rot in (cfg.yarn_beta_fast, cfg.yarn_beta_slow))
    if cfg.yarn_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, r - 1)
    high += 0.001 if low == high else 0  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(r // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)  # (r/2,)
    keep = 1 - ramp  # 1: theta_i kept (fast dims), 0: theta_i / s (slow dims)
    inv_freq = (1.0 / (s * pos_freqs)) * (1 - keep) + inv_freq * keep
    return inv_freq, cfg.rope_attention_factor or (0.1 * math.log(s) + 1.0 if s > 1 else 1.0)


class KVCache:
    """Static per-layer key/value cache [B, J, S, d], addressed by absolute column."""

    def __init__(self, cfg: ModelConfig, batch_size: int, max_len: int, *, dtype, device):
        # (n_layers, B, J, S, d): every block, dense ones too, in one allocation made once
        shape = (cfg.n_layers, batch_size, cfg.n_kv_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def update(self, layer: int, start: int, k_BJTd, v_BJTd):
        """Write this call's keys/values at columns [start, start+T); return all columns so far."""
        end = start + k_BJTd.shape[2]
        self.k[layer, :, :, start:end] = k_BJTd
        self.v[layer, :, :, start:end] = v_BJTd
        # columns from end on are unwritten: returning only [:end] keeps them out of attention
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]  # (B, J, end, d) each

    def update_rows(self, layer: int, col_B: torch.Tensor, k_BJ1d, v_BJ1d, width: int):
        """Write one token per row at that row's own column col_B [B] int64 (continuous batching: each
        row is a slot at its own length); return columns [0, width) of every row, width covering every
        row's columns so far (the caller's mask hides, per row, those it has not written)."""
        B, J, _, d = k_BJ1d.shape
        index = col_B.view(B, 1, 1, 1).expand(B, J, 1, d)  # (B, J, 1, d): row b's column col_B[b], every head and dim
        self.k[layer].scatter_(2, index, k_BJ1d)
        self.v[layer].scatter_(2, index, v_BJ1d)
        return self.k[layer, :, :, :width], self.v[layer, :, :, :width]  # (B, J, width, d) each


class Attention(nn.Module):
    """Causal GQA self-attention with RoPE, optional q/k norm and q/k/v (and o) bias, training or cached."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        H, J, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        # rows [q (H*d) | k (J*d) | v (J*d)]: one GEMM for all three; hf.py splits them back in this order
        self.wqkv = nn.Linear(cfg.dim, (H + 2 * J) * d, bias=cfg.attention_bias)
        self.wo = nn.Linear(H * d, cfg.dim, bias=cfg.attention_out_bias)
        self.q_norm = RMSNorm(d, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.norm_eps) if cfg.qk_norm else None

    def forward(self, x_BTD, cos, sin, cache: KVCache | None, cache_start: int | torch.Tensor, mask_B1TS):
        # cache_start: one column for every row, or a [B] tensor of per-row columns (one token per row,
        # continuous batching: KVCache.update_rows), mask_B1TS then covering the columns attended
        B, T, _ = x_BTD.shape
        cfg = self.cfg
        qkv = self.wqkv(x_BTD).view(B, T, cfg.n_heads + 2 * cfg.n_kv_heads, cfg.head_dim)  # (B, T, H+2J, d)
        q, k, v = qkv.split([cfg.n_heads, cfg.n_kv_heads, cfg.n_kv_heads], dim=2)  # (B, T, H|J|J, d)
        v = v.transpose(1, 2)  # (B, J, T, d)
        if self.q_norm is not None:
            # Qwen3's q/k norm: RMSNorm over each head's d dims, before RoPE as HF applies it
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin)  # (B, H|J, T, d)
        if cache is not None and isinstance(cache_start, torch.Tensor):  # per-row columns: (B, J, W, d)
            k, v = cache.update_rows(self.layer, cache_start, k, v, width=mask_B1TS.shape[-1])
        elif cache is not None:
            k, v = cache.update(self.layer, cache_start, k, v)  # (B, J, S, d)
        if T == 1 and cache is not None:  # a decode step: one query per row against the cache
            y = single_query_attention(q, k, v, mask_B1TS)  # (B, H, 1, d)
        else:
            # mask_B1TS: True (or 0) = attend; without one, causal over this call's tokens (training). SDPA's
            # is_causal mask is aligned to the top left, which is this call's causal mask only when S == T
            # (cache_start == 0); later cached calls must pass a mask
            y = fused_attention(q, k, v, mask_B1TS, call="trainer forward" if cache is None else "engine prefill")
        return self.wo(y.transpose(1, 2).reshape(B, T, cfg.n_heads * cfg.head_dim))  # (B, T, H*d) -> (B, T, D)


class FeedForward(nn.Module):
    """SwiGLU FFN w2(silu(w1 x) * w3 x), with w1 and w3 fused into one matrix w13 (one GEMM, not two)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w13 = nn.Linear(dim, 2 * hidden, bias=False)  # [gate; up] rows, the order `swiglu` splits
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(swiglu(self.w13(x)))  # (..., 2 hidden) -> (..., hidden) -> (..., dim)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by `scale` on the way back."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        # a view, not x itself: the output carries this Function's grad_fn and x keeps its own
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None  # no gradient for the float scale


class GroupedExperts(nn.Module):
    """E SwiGLU experts stacked for grouped GEMMs: w13 [E, D, 2I] (gate | up), w2 [E, I, D].

    Each expert's matrices are [in, out], so rows x its matrix need no transpose; HF stores
    [out, in] per expert, and hf.py transposes on the way in and out.
    """

    def __init__(self, num_experts: int, dim: int, hidden: int):
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(num_experts, dim, 2 * hidden))  # (E, D, 2I): gate and up, fused
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, dim))  # (E, I, D): down projection

    grad_scale = 1.0  # set by distributed.parallelize: expert gradients under EP are divided by ep

    def forward(self, x_RD: torch.Tensor, counts_e: torch.Tensor) -> torch.Tensor:
        """Rows sorted by local expert (counts_e[i] rows for this rank's i-th expert) -> expert outputs,
        same order."""
        # under EP the weights are DTensors sharded on the expert dim: this rank's experts as plain tensors; in the
        # rows' dtype (EP-only experts sit outside FSDP's mixed precision, which casts every other weight)
        # (asked of the class: dynamo answers hasattr on a DTensor instance False, and the graph would get the DTensor)
        w13, w2 = ((w.to_local() if hasattr(type(w), "to_local") else w).to(x_RD.dtype) for w in (self.w13, self.w2))
        if self.grad_scale != 1.0:
            # under EP an expert's gradient sums the tokens of every rank of its group: the scale (1 / ep) makes it
            # the same data-parallel mean as the dense weights'
            w13, w2 = _ScaleGrad.apply(w13, self.grad_scale), _ScaleGrad.apply(w2, self.grad_scale)
        offs = counts_e.cumsum(0).to(torch.int32)  # (E,) where each expert's rows end
        return grouped_mm(swiglu(grouped_mm(x_RD, w13, offs)), w2, offs)  # (R, 2I) -> (R, I) -> (R, D)


def run_experts(experts: nn.Module, x_ND: torch.Tensor, ids_NK: torch.Tensor, weights_NK: torch.Tensor) -> torch.Tensor:
    """Weighted sum over each token's K routed experts [N, D], in x's dtype (all experts local).

    The N*K (token, expert) pairs are sorted by expert, so two grouped GEMMs run over exactly
    the routed rows (no capacity padding), then permuted back to (token, k) order and summed
    with the gate weights in fp32. Sorting and its inverse are permutations, so no row is
    scatter-added in either direction; no host sync (shapes never depend on the routes).
    """
    N, K = ids_NK.shape
    pair_R = ids_NK.flatten()  # (R,) the expert of pair p = n*K + k
    # (E,) rows per expert; scatter_add_, not bincount, which syncs with the host on CUDA
    counts_E = pair_R.new_zeros(experts.w13.shape[0]).scatter_add_(0, pair_R, torch.ones_like(pair_R))
    # (R,) pair ids p = n*K + k in expert order; stable, so within an expert the pairs keep token order
    # and the result does not depend on the sort's tie-breaking
    order_R = pair_R.argsort(stable=True)
    # (R,) the inverse permutation: inverse_R[p] = the sorted row of pair p (each index written once)
    inverse_R = torch.empty_like(order_R).scatter_(0, order_R, torch.arange(N * K, device=order_R.device))
    # sorted row r holds token order_R[r] // K; the gather's backward reads through inverse_R and sums
    # each token's K copies, a gather again instead of a scatter-add
    out_RD = experts(gather_rows(x_ND, order_R // K, inverse_R, K), counts_E)  # (N*K, D) by expert
    out_NKD = gather_rows(out_RD, inverse_R, order_R, 1).view(N, K, -1)  # back to (token, k) order
    return (out_NKD.float() * weights_NK[..., None]).sum(1).to(x_ND.dtype)  # (N, D), weighted in fp32


class RouterGate(nn.Linear):
    """The router's linear map, always in fp32 (input and weight upcast). A module of its own, called, so
    that FSDP gathers its weight (in fp32: distributed.parallelize gives it its own fp32 policy)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())


class MoE(nn.Module):
    """Routed top-k SwiGLU experts plus an optional shared expert."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.gate = RouterGate(cfg.dim, cfg.num_experts, bias=False)  # router, (E, D)
        # aux-loss-free selection bias (sigmoid router); loaded, never trained by gradient. Persistent only for
        # the sigmoid router: Qwen3 checkpoints have no such tensor
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts), persistent=cfg.router == "sigmoid")
        self.experts = GroupedExperts(cfg.num_experts, cfg.dim, cfg.moe_inter_dim)
        # n shared experts as one SwiGLU n times as wide: the sum of their outputs, with one pair of GEMMs
        self.shared = FeedForward(cfg.dim, cfg.num_shared_experts * cfg.moe_inter_dim) if cfg.num_shared_experts else None
        self.dispatcher = None  # expert-parallel token dispatch, set by distributed.parallelize
        # equal-split all-to-all over the ep group (distributed.parallelize), for ep_decode.capacity_experts
        self.exchange = None
        # inside ep_decode.capacity_dispatch: the fixed-shape experts call no-grad forwards take (no host sync)
        self.capacity = None

    def route(self, x_ND: torch.Tensor, replay_NK: torch.Tensor | None):
        """Expert ids [N, K] int64 and gate weights [N, K] fp32 (R3: replayed ids, live scores)."""
        cfg = self.cfg
        logits_NE = self.gate(x_ND)  # (N, E) fp32: a bf16 logit can flip a near-tie in the top-k (notable choice 1)
        if cfg.router == "softmax":
            scores_NE = logits_NE.softmax(dim=-1)  # Qwen3-MoE: probabilities over all E experts
            choice_NE = scores_NE  # the choice and the weights read the same scores
        else:
            scores_NE = logits_NE.sigmoid()  # DeepSeek-V3 eq. 15: s = sigmoid(u^T e)
            # eq. 16: the bias b moves only which experts are chosen; the weights below read s without it
            choice_NE = scores_NE + self.expert_bias.float()
            # partition-limited routing (DeepSeek-V3's node-limited): only the topk_group partitions whose best
            # two experts score highest. Two as HF hard-codes it: DeepSeek-V3's top_k / topk_group = 8 / 4
            if cfg.n_group > 1:
                N, E = choice_NE.shape
                M = cfg.n_group  # expert partitions of E / M consecutive experts each
                # (N, M, E/M) -> (N, M): the sum of each partition's two best scores
                part_NM = choice_NE.view(N, M, E // M).topk(2, dim=-1).values.sum(-1)
                # (N, M): 1.0 on the topk_group chosen partitions
                keep_NM = torch.zeros_like(part_NM).scatter_(1, part_NM.topk(cfg.topk_group, dim=-1).indices, 1.0)
                keep_NE = keep_NM[:, :, None].expand(N, M, E // M).reshape(N, E)  # (N, M, E/M) -> (N, E)
                # -inf: an expert outside the chosen partitions never wins the top-k below
                choice_NE = choice_NE.masked_fill(keep_NE == 0, float("-inf"))
        # (N, K) the router's own choice; needed under replay too, for the padding rows
        own_NK = choice_NE.topk(cfg.top_k, dim=-1).indices
        if replay_NK is None:
            ids_NK = own_NK
        else:
            pad_N1 = (replay_NK < 0).all(dim=-1, keepdim=True)  # padding rows route as the router would
            ids_NK = torch.where(pad_N1, own_NK, replay_NK.long())  # (N, K)
        # (N, K) live scores at the chosen (or replayed) ids: the gradient reaches the router through them
        weights_NK = scores_NE.gather(-1, ids_NK)
        if cfg.norm_topk_prob:
            # weights over the chosen set sum to 1 (DeepSeek-V3 eq. 13; Qwen3's norm_topk_prob).
            # The sigmoid router's epsilon is HF GLM-4.5's; softmax scores always sum above zero
            weights_NK = weights_NK / (weights_NK.sum(-1, keepdim=True) + (1e-20 if cfg.router == "sigmoid" else 0.0))
        return ids_NK, weights_NK * cfg.routed_scaling_factor

    def forward(self, x_BTD: torch.Tensor, replay_BTK: torch.Tensor | None):
        B, T, D = x_BTD.shape
        K, E = self.cfg.top_k, self.cfg.num_experts
        x_ND = x_BTD.reshape(B * T, D)  # (N, D)
        # replay (B, T, K) -> (N, K)
        ids_NK, weights_NK = self.route(x_ND, None if replay_BTK is None else replay_BTK.reshape(B * T, K))
        if self.dispatcher is not None and self.capacity is not None and not torch.is_grad_enabled():
            # expert parallel, fixed shapes (ep_decode.capacity_dispatch): no host sync, the same numbers as below
            y_ND = self.capacity(self.experts, x_ND, ids_NK, weights_NK)
        elif self.dispatcher is not None:  # expert parallel: all-to-all to the ranks that own the experts
            # (E,) routed rows per expert; bincount's host sync adds nothing here: the dispatcher reads its
            # all-to-all split sizes on the host
            counts_E = torch.bincount(ids_NK.flatten(), minlength=E)
            # x_RD: the rows this rank's experts receive from every rank (not N*K of them), sorted by local expert
            x_RD, counts_e, meta = self.dispatcher.dispatch(x_ND, weights_NK, ids_NK, counts_E)
            # torchtitan's combine: back to the tokens' ranks, weighted (cast back to the expert dtype before the
            # sum, unlike run_experts' fp32 sum) and scatter-added over k
            y_ND = self.dispatcher.combine(self.experts(x_RD, counts_e), meta, x_ND)  # (N, D)
        else:
            y_ND = run_experts(self.experts, x_ND, ids_NK, weights_NK)  # (N, D)
        if self.shared is not None:
            y_ND = y_ND + self.shared(x_ND)  # every token, unweighted (DeepSeek-V3 eq. 12)
        return y_ND.view(B, T, D), ids_NK.view(B, T, K)  # (B, T, D), (B, T, K)


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + ffn(norm(x)), the FFN dense or MoE."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg, layer)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.is_moe = layer >= cfg.first_k_dense_replace  # dense blocks come first (GLM-4.5)
        self.mlp = MoE(cfg) if self.is_moe else FeedForward(cfg.dim, cfg.dense_inter_dim)

    def forward(self, x_BTD, cos, sin, cache, cache_start, mask, replay_BTK):
        x_BTD = x_BTD + self.attn(self.attn_norm(x_BTD), cos, sin, cache, cache_start, mask)
        if not self.is_moe:
            return x_BTD + self.mlp(self.ffn_norm(x_BTD)), None  # a dense block routes nothing
        y_BTD, ids_BTK = self.mlp(self.ffn_norm(x_BTD), replay_BTK)
        return x_BTD + y_BTD, ids_BTK


class Transformer(nn.Module):
    """Embedding, `n_layers` blocks, a final RMSNorm and lm_head; see `forward`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight  # one Parameter: one storage, one gradient
        # a meta-device model (parallelize, load_hf) has no storage yet; whoever materialises it fills it
        if not any(p.is_meta for p in self.parameters()):
            self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """Normal(0, init_std) matrices, residual-branch outputs scaled by 1/sqrt(2 n_layers)
        (GPT-2, Radford et al. 2019); norms 1; biases and the expert bias 0."""
        std = self.cfg.init_std
        for name, p in self.named_parameters():  # a tied weight once, under its embedding name
            if name.endswith("norm.weight"):  # 1-D like the biases, so tested first
                p.fill_(1.0)
            elif p.dim() == 1:
                p.zero_()
            else:
                # wo and w2 end a residual branch, two per block: GPT-2 scales them by 1/sqrt(2 n_layers) so
                # the stream's variance does not grow with depth. "w2" alone is the stacked experts' Parameter
                out_proj = name.endswith(("wo.weight", "w2", "w2.weight"))
                p.normal_(0.0, std / math.sqrt(2 * self.cfg.n_layers) if out_proj else std)
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
            check_route_layout(routed_experts, (B, T, self.cfg.num_moe_layers, self.cfg.top_k))
        if pos_BT is None:
            # 0 .. T-1 in every row, whatever cache_start is: a cached call past column 0 passes its positions
            pos_BT = torch.arange(T, device=tokens_BT.device).expand(B, T)  # (B, T)
        cos, sin = rope(pos_BT, self.cfg)  # (B, T, r) each, computed once for every layer
        x = self.embed(tokens_BT)  # (B, T, D)
        routes, moe_i = [], 0  # moe_i indexes MoE layers only, as L does: dense blocks do not advance it
        for layer in self.layers:
            replay = None
            if layer.is_moe and routed_experts is not None:
                replay = routed_experts[:, :, moe_i]  # (B, T, K)
            x, ids_BTK = layer(x, cos, sin, cache, cache_start, mask_B1TS, replay)
            if layer.is_moe:
                routes.append(ids_BTK)
                moe_i += 1
        # L tensors of (B, T, K) -> (B, T, L, K); None as well when no block is MoE
        return self.norm(x), (torch.stack(routes, dim=2) if return_routes and routes else None)

    def forward(self, tokens_BT: torch.Tensor, targets_BT: torch.Tensor | None = None, *, temperature: float = 1.0,
                **kwargs):
        """Without targets: logits [B, T, V] fp32 and, if `return_routes`, expert ids [B, T, L, K] int64
        (else None). With targets_BT [B, T] int64: (log pi(target), entropy) [B, T] fp32 each under
        softmax(logits / temperature), and the routes; the [B, T, V] logits are never held at once
        (`chunked_logprobs`): what a trainer calls.

        tokens_BT: int64 token ids. pos_BT: RoPE positions (default 0..T-1 per row).
        routed_experts: int [B, T, L, K] ids to replay (R3, arXiv 2510.11370), L = MoE
        layers only; rows of -1 route freely.
        cache / cache_start / mask_B1TS: cached decoding; keys and values of this call are
        written at cache columns [cache_start, cache_start+T); mask_B1TS (bool, True = attend, or
        additive float, 0 = attend) covers all S = cache_start+T columns. Without a mask attention is causal, which is
        right only when cache_start = 0 (SDPA aligns its causal mask to the top left).
        Raises ValueError on a replay of another shape or a float dtype (the ids' values are checked
        once, where they enter from outside: sglang_server.check_routes).
        """
        h, routes = self.hidden(tokens_BT, **kwargs)
        if targets_BT is None:
            # lm_head in the parameters' dtype; the logits in fp32 for the log-softmax downstream
            return self.lm_head(h).float(), routes
        # inside forward, not after it: under FSDP the lm_head weight is gathered only while forward runs
        logp_BT, entropy_BT = chunked_logprobs(h, self.lm_head.weight, targets_BT, temperature=temperature)
        return (logp_BT, entropy_BT), routes


def route_dtype(num_experts: int) -> torch.dtype:
    """The smallest integer dtype that holds expert ids 0..num_experts - 1: what a Rollout's routes are
    kept and moved in (uint8 up to 256 experts: a quarter of SGLang's int32). The trainer pads with -1
    only once they are in its own int32 batch."""
    for dtype in (torch.uint8, torch.int16, torch.int32):
        if num_experts - 1 <= torch.iinfo(dtype).max:
            return dtype
    raise ValueError(f"num_experts={num_experts} exceeds int32 expert ids")


def check_route_layout(routed_experts: torch.Tensor, want: tuple):
    """The dtype and shape of replayed expert ids: no host sync, so every replayed forward may afford it.
    Raises ValueError naming what is wrong."""
    if routed_experts.is_floating_point() or routed_experts.is_complex() or routed_experts.dtype == torch.bool:
        # a float id would be truncated by the gather's .long(): 2.7 replays expert 2, silently
        raise ValueError(f"routed_experts has dtype {routed_experts.dtype}; expert ids must be integers")
    if tuple(routed_experts.shape) != want:
        raise ValueError(f"routed_experts has shape {tuple(routed_experts.shape)}, expected {want} (B, T, L, K)")
