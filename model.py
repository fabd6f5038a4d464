"""A native mixture-of-experts decoder with replayable routing.

One `Transformer` serves training (full causal forward) and cached decoding (a static
KV cache addressed by position, gpt-fast style). Each block is pre-norm attention plus a
mixture-of-experts FFN:

- RMSNorm, rotary position embeddings (RoPE, arXiv 2104.09864), grouped-query
  attention (GQA, arXiv 2305.13245) through `F.scaled_dot_product_attention`.
- Top-k routed experts with a softmax router and top-k renormalisation (the Qwen3-MoE
  form): g_i = I_i exp(s_i) / sum_j I_j exp(s_j), I the top-k indicator; SwiGLU experts;
  an optional always-on shared expert.
- Router replay (R3, arXiv 2510.11370): `forward` can return the top-k expert ids each
  MoE layer chose for every token, and can take such ids back. Replayed ids replace the
  router's own top-k; the gate weights are recomputed from the live router scores over
  the given ids (the softmax above with I the replayed set), so the router still gets a
  gradient. A replayed row of -1 (padding) falls back to the router's own choice.

Notable choices: the router runs in fp32 whatever the model dtype (routing is where
precision flips discrete decisions); experts run through `torch._grouped_mm` where it
applies, else a per-expert loop with the same result.

Shape legend: B batch, T tokens in this call, S cache length, D model dim, H query heads,
G kv heads, d head dim, E routed experts, K experts per token, I expert hidden dim,
L MoE layers, V vocabulary, N flattened tokens (B*T).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ModelConfig:
    vocab_size: int = 512
    """Rows of the embedding and lm_head."""
    dim: int = 256
    """Residual stream width D."""
    n_layers: int = 4
    """Decoder blocks; every block has a MoE FFN."""
    n_heads: int = 8
    """Query heads H."""
    n_kv_heads: int = 2
    """Key/value heads G (GQA); must divide n_heads."""
    head_dim: int = 32
    """Per-head width d; must be even for RoPE."""
    num_experts: int = 16
    """Routed experts E per MoE layer."""
    top_k: int = 4
    """Experts K each token is routed to."""
    moe_inter_dim: int = 256
    """Hidden width I of each routed expert (SwiGLU)."""
    num_shared_experts: int = 0
    """Always-on shared experts, fused into one SwiGLU of width num * moe_inter_dim; 0 = none."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    max_seq_len: int = 1024
    """Longest position the RoPE table covers (prompt + completion)."""
    tie_embeddings: bool = False
    """Share the embedding matrix with lm_head."""
    init_std: float = 0.02
    """Std of the normal init of every weight matrix (GPT-2's value)."""

    def __post_init__(self):
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                     "num_experts", "top_k", "moe_inter_dim", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name}={getattr(self, name)} must be positive")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")

    @property
    def num_moe_layers(self) -> int:
        return self.n_layers


def rope_tables(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each [max_seq_len, head_dim // 2] fp32 (arXiv 2104.09864 eq. 34)."""
    inv_freq = cfg.rope_theta ** -(torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim)
    angles = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x_BHTd: torch.Tensor, cos_BTd: torch.Tensor, sin_BTd: torch.Tensor) -> torch.Tensor:
    """Rotate halves (the HF/Llama "rotate_half" layout, so HF checkpoints load as they are)."""
    x1, x2 = x_BHTd.float().chunk(2, dim=-1)
    cos, sin = cos_BTd[:, None], sin_BTd[:, None]  # (B, 1, T, d/2) broadcast over heads
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.type_as(x_BHTd)


class KVCache:
    """Static per-layer key/value cache [B, G, S, d], addressed by absolute column."""

    def __init__(self, cfg: ModelConfig, batch_size: int, max_len: int, *, dtype, device):
        shape = (cfg.n_layers, batch_size, cfg.n_kv_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def update(self, layer: int, start: int, k_BGTd, v_BGTd):
        """Write this call's keys/values at columns [start, start+T); return all columns so far."""
        end = start + k_BGTd.shape[2]
        self.k[layer, :, :, start:end] = k_BGTd
        self.v[layer, :, :, start:end] = v_BGTd
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x_BTD, cos_BTd, sin_BTd, cache: KVCache | None, cache_start: int, mask_B1TS):
        B, T, _ = x_BTD.shape
        cfg = self.cfg
        q = self.wq(x_BTD).view(B, T, cfg.n_heads, cfg.head_dim).transpose(1, 2)  # (B, H, T, d)
        k = self.wk(x_BTD).view(B, T, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)  # (B, G, T, d)
        v = self.wv(x_BTD).view(B, T, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)  # (B, G, T, d)
        q, k = apply_rope(q, cos_BTd, sin_BTd), apply_rope(k, cos_BTd, sin_BTd)
        if cache is not None:
            k, v = cache.update(self.layer, cache_start, k, v)  # (B, G, S, d)
        # mask None means plain causal over this call's tokens (training, no padding on the left)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_B1TS, is_causal=mask_B1TS is None,
                                           enable_gqa=cfg.n_heads != cfg.n_kv_heads)  # (B, H, T, d)
        return self.wo(y.transpose(1, 2).reshape(B, T, cfg.n_heads * cfg.head_dim))


def grouped_mm(x_Nin: torch.Tensor, w_Ein_out: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """Rows of x sorted by expert times that expert's matrix; offs_E = cumulative row counts (int32).

    Uses `torch._grouped_mm` where it applies (CPU any float dtype; CUDA bf16 with 16-byte
    aligned strides), else an exact per-expert loop.
    """
    aligned = all((s * x_Nin.element_size()) % 16 == 0 for s in w_Ein_out.shape[1:])
    if hasattr(torch, "_grouped_mm") and (x_Nin.device.type == "cpu" or x_Nin.dtype == torch.bfloat16) and aligned:
        return torch._grouped_mm(x_Nin, w_Ein_out, offs=offs_E)
    outs, start = [], 0
    for e, end in enumerate(offs_E.tolist()):
        outs.append(x_Nin[start:end] @ w_Ein_out[e])
        start = end
    return torch.cat(outs)


class MoE(nn.Module):
    """Softmax-routed top-k SwiGLU experts plus an optional shared expert."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        E, D, I = cfg.num_experts, cfg.dim, cfg.moe_inter_dim
        self.gate = nn.Linear(D, E, bias=False)  # router
        self.w1 = nn.Parameter(torch.empty(E, D, I))  # gate projection, per expert
        self.w3 = nn.Parameter(torch.empty(E, D, I))  # up projection
        self.w2 = nn.Parameter(torch.empty(E, I, D))  # down projection
        self.shared = None
        if cfg.num_shared_experts:
            Is = cfg.num_shared_experts * I
            self.shared = nn.ModuleDict(dict(w1=nn.Linear(D, Is, bias=False), w3=nn.Linear(D, Is, bias=False),
                                             w2=nn.Linear(Is, D, bias=False)))

    def route(self, x_ND: torch.Tensor, replay_NK: torch.Tensor | None):
        """Expert ids [N, K] int64 and gate weights [N, K] fp32 (R3: replayed ids, live scores)."""
        scores_NE = F.linear(x_ND.float(), self.gate.weight.float())
        own_NK = scores_NE.topk(self.cfg.top_k, dim=-1).indices
        if replay_NK is None:
            ids_NK = own_NK
        else:
            pad_N1 = (replay_NK < 0).all(dim=-1, keepdim=True)  # padding rows route as the router would
            ids_NK = torch.where(pad_N1, own_NK, replay_NK.long())
        # softmax over the chosen scores == top-k renormalised softmax over all E
        weights_NK = scores_NE.gather(-1, ids_NK).softmax(dim=-1)
        return ids_NK, weights_NK

    def forward(self, x_BTD: torch.Tensor, replay_BTK: torch.Tensor | None):
        B, T, D = x_BTD.shape
        K = self.cfg.top_k
        x_ND = x_BTD.reshape(B * T, D)
        ids_NK, weights_NK = self.route(x_ND, None if replay_BTK is None else replay_BTK.reshape(B * T, K))
        # dispatch: sort the N*K (token, expert) pairs by expert so each expert's rows are contiguous
        order = ids_NK.flatten().argsort(stable=True)  # (N*K,)
        token_of = order // K
        counts_E = torch.bincount(ids_NK.flatten(), minlength=self.cfg.num_experts)
        offs_E = counts_E.cumsum(0).to(torch.int32)
        xs = x_ND[token_of]  # (N*K, D) rows grouped by expert
        h = F.silu(grouped_mm(xs, self.w1, offs_E)) * grouped_mm(xs, self.w3, offs_E)  # (N*K, I)
        ys = grouped_mm(h, self.w2, offs_E) * weights_NK.flatten()[order, None].to(h.dtype)  # (N*K, D)
        y_ND = torch.zeros_like(x_ND).index_add_(0, token_of, ys)
        if self.shared is not None:
            s = self.shared
            y_ND = y_ND + s.w2(F.silu(s.w1(x_ND)) * s.w3(x_ND))
        return y_ND.view(B, T, D), ids_NK.view(B, T, K)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attn = Attention(cfg, layer)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.moe = MoE(cfg)

    def forward(self, x_BTD, cos, sin, cache, cache_start, mask, replay_BTK):
        x_BTD = x_BTD + self.attn(self.attn_norm(x_BTD), cos, sin, cache, cache_start, mask)
        y_BTD, ids_BTK = self.moe(self.ffn_norm(x_BTD), replay_BTK)
        return x_BTD + y_BTD, ids_BTK


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        cos, sin = rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None):
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)  # norm weights
            else:
                # residual-branch outputs scaled down by depth (GPT-2, Radford et al. 2019)
                out_proj = name.endswith(("wo.weight", "w2", "w2.weight"))
                p.normal_(0.0, std / math.sqrt(2 * self.cfg.n_layers) if out_proj else std, generator=generator)

    def forward(self, tokens_BT: torch.Tensor, *, pos_BT: torch.Tensor | None = None,
                routed_experts: torch.Tensor | None = None, return_routes: bool = False,
                cache: KVCache | None = None, cache_start: int = 0, mask_B1TS: torch.Tensor | None = None):
        """Logits [B, T, V] fp32 and, if `return_routes`, expert ids [B, T, L, K] int64 (else None).

        tokens_BT: int64 token ids. pos_BT: RoPE positions (default 0..T-1 per row).
        routed_experts: int [B, T, L, K] ids to replay (R3, arXiv 2510.11370); rows of -1 route freely.
        cache / cache_start / mask_B1TS: cached decoding; keys and values of this call are
        written at cache columns [cache_start, cache_start+T); mask_B1TS (bool, True = attend)
        covers all S = cache_start+T columns. Without a mask attention is causal.
        Raises ValueError on a wrong replay shape, an expert id outside [-1, E), a row that
        mixes -1 with ids, or a row that repeats an expert.
        """
        B, T = tokens_BT.shape
        cfg = self.cfg
        if routed_experts is not None:
            want = (B, T, cfg.num_moe_layers, cfg.top_k)
            if tuple(routed_experts.shape) != want:
                raise ValueError(f"routed_experts has shape {tuple(routed_experts.shape)}, expected {want} (B, T, L, K)")
            lo, hi = int(routed_experts.min()), int(routed_experts.max())
            if lo < -1 or hi >= cfg.num_experts:
                raise ValueError(f"routed_experts ids span [{lo}, {hi}]; valid ids are -1 (padding) and [0, {cfg.num_experts})")
            pad = routed_experts < 0
            if bool((pad.any(-1) & ~pad.all(-1)).any()):
                raise ValueError("routed_experts has a row mixing -1 and expert ids; a padding row must be all -1")
            ids = routed_experts.sort(dim=-1).values
            if bool(((ids[..., 1:] == ids[..., :-1]) & (ids[..., 1:] >= 0)).any()):
                raise ValueError("routed_experts repeats an expert within a token's top-k; ids in a row must be distinct")
        if pos_BT is None:
            pos_BT = torch.arange(T, device=tokens_BT.device).expand(B, T)
        cos, sin = self.rope_cos[pos_BT], self.rope_sin[pos_BT]  # (B, T, d/2)
        x = self.embed(tokens_BT)
        routes = []
        for i, layer in enumerate(self.layers):
            replay = None if routed_experts is None else routed_experts[:, :, i]
            x, ids_BTK = layer(x, cos, sin, cache, cache_start, mask_B1TS, replay)
            routes.append(ids_BTK)
        logits = self.lm_head(self.norm(x)).float()
        return logits, (torch.stack(routes, dim=2) if return_routes else None)


def token_logprobs(logits_BTV: torch.Tensor, targets_BT: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log pi(target) [B, T] fp32 under softmax(logits / temperature)."""
    logp = (logits_BTV.float() / temperature).log_softmax(dim=-1)
    return logp.gather(-1, targets_BT.unsqueeze(-1)).squeeze(-1)


def token_entropy(logits_BTV: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Full-vocabulary entropy -sum_v p log p [B, T] fp32, in nats."""
    logp = (logits_BTV.float() / temperature).log_softmax(dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)
