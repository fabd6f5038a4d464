"""Dry-run planning: parameter counts and a per-GPU memory plan, from a meta-device model.

`python train.py configs/100b.py dry_run=True` builds the model on the meta device
(nothing is allocated), counts its parameters and prints, for 1, 2, 4 and 8 nodes, what
each GPU holds under FSDP2 + expert parallel as `model.parallelize` applies it:

- sharded state: every parameter is sharded dp_shard ways (dense ones by FSDP, experts
  ep ways by expert parallel times dp_shard/ep ways by FSDP), kept as an fp32 master copy
  with an fp32 gradient and AdamW's two fp32 moments: 16 bytes per parameter / dp_shard;
- unsharded working set: the largest block all-gathered in param_dtype, twice (the next
  block is prefetched), plus its gradient in fp32 before the reduce-scatter;
- activations, an estimate: with activation checkpointing each block keeps its input
  (tokens x D) and one block at a time holds its full working set; without, every
  block holds it. The working set per token counts the residual stream and norms,
  q/k/v/o, the routed expert inputs and hidden states (K copies) and the shared/dense
  FFN, in param_dtype; plus fp32 logits for LOGITS_CHUNK_TOKENS positions (a chunked trainer,
  which the GPU-ready numerics issue builds: today's trainer holds a micro-batch's whole logits).

The rollout engine's memory (SGLang's own fraction of the GPU) is not included.
Legend: P parameters, W GPUs (world), D model dim, K experts per token, I expert width.
"""

from __future__ import annotations

import torch

from model import ModelConfig, Transformer

GB = 1024 ** 3
BYTES_STATE = 4 + 4 + 8  # fp32 master param, fp32 grad, AdamW exp_avg + exp_avg_sq
LOGITS_CHUNK_TOKENS = 4096  # positions of fp32 logits alive at once in a chunked trainer
GPU_MEMORY_GB = {"H100 80GB": 80, "H200 141GB": 141}


def param_counts(cfg: ModelConfig) -> dict:
    """Total, routed-expert and active parameters of the model, counted on the meta device.

    Active = total minus the routed experts a token does not use: (E - K) / E of them.
    Embedding and lm_head count in both.
    """
    with torch.device("meta"):
        model = Transformer(cfg)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for b in model.layers if b.is_moe for p in b.mlp.experts.parameters())
    active = total - experts * (cfg.num_experts - cfg.top_k) // cfg.num_experts
    blocks = [sum(p.numel() for p in b.parameters()) for b in model.layers]
    block_experts = [sum(p.numel() for p in b.mlp.experts.parameters()) if b.is_moe else 0 for b in model.layers]
    outer = sum(p.numel() for p in model.embed.parameters()) + sum(p.numel() for p in model.lm_head.parameters())
    return {"total": total, "experts": experts, "active": active, "blocks": blocks,
            "block_experts": block_experts, "embed_lm_head": outer}


def memory_plan(cfg: ModelConfig, counts: dict, *, world: int, ep: int, microbatch_tokens: int,
                activation_checkpoint: bool, param_bytes: int = 2) -> dict:
    """Bytes per GPU of each part of the plan above, for `world` GPUs all in dp_shard.

    Raises ValueError if ep does not divide num_experts or world.
    """
    if cfg.num_experts % ep or world % ep:
        raise ValueError(f"ep={ep} must divide num_experts={cfg.num_experts} and the GPU count {world}")
    state = counts["total"] * BYTES_STATE / world
    # one block unsharded: its dense part whole, its experts only the local 1/ep
    unsharded = max(b - e + e / ep for b, e in zip(counts["blocks"], counts["block_experts"]))
    unsharded = max(unsharded, counts["embed_lm_head"])
    gather = unsharded * (2 * param_bytes + 4)
    D, K, L = cfg.dim, cfg.top_k, cfg.n_layers
    attn = (2 * cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim  # q, k, v, attention output
    ffn = K * (D + 3 * cfg.moe_inter_dim) + 3 * max(cfg.num_shared_experts * cfg.moe_inter_dim, cfg.dense_inter_dim)
    per_token_block = (6 * D + attn + ffn) * param_bytes  # residuals and norms, attention, experts, shared/dense
    t = microbatch_tokens
    acts = (L * t * D * param_bytes + t * per_token_block) if activation_checkpoint else L * t * per_token_block
    logits = min(t, LOGITS_CHUNK_TOKENS) * cfg.vocab_size * 4 * 3  # logits, log-softmax, its exp
    parts = {"params+grads+adam": state, "gathered block": gather, "activations": acts, "logits chunk": logits}
    parts["total"] = sum(parts.values())
    return parts


def print_plan(cfg: ModelConfig, *, gpus_per_node: int, ep: int, microbatch_tokens: int,
               activation_checkpoint: bool, nodes=(1, 2, 4, 8)) -> list[dict]:
    """Print parameter counts and the per-GPU plan for each node count; return the plan rows."""
    counts = param_counts(cfg)
    n = lambda x: f"{x / 1e9:.2f}B" if x >= 1e8 else f"{x / 1e6:.2f}M"  # noqa: E731
    print(f"parameters: {n(counts['total'])} total, {n(counts['active'])} active per token "
          f"({n(counts['active'] - counts['embed_lm_head'])} without embedding and lm_head), "
          f"{n(counts['experts'])} in routed experts")
    print(f"per GPU, {microbatch_tokens} tokens per micro-batch, activation checkpointing "
          f"{'on' if activation_checkpoint else 'off'}, bf16 compute (GB):")
    cols = ["params+grads+adam", "gathered block", "activations", "logits chunk", "total"]
    print(f"{'nodes':>5} {'GPUs':>5} {'dp_shard':>8} {'ep':>3}  " + "  ".join(f"{c:>17}" for c in cols) + "  fits")
    rows = []
    for n in nodes:
        world = n * gpus_per_node
        if world % ep:
            print(f"{n:>5} {world:>5}  ep={ep} does not divide {world} GPUs")
            continue
        plan = memory_plan(cfg, counts, world=world, ep=ep, microbatch_tokens=microbatch_tokens,
                           activation_checkpoint=activation_checkpoint)
        fits = [name for name, gb in GPU_MEMORY_GB.items() if plan["total"] / GB <= gb]
        print(f"{n:>5} {world:>5} {world:>8} {ep:>3}  " + "  ".join(f"{plan[c] / GB:>17.1f}" for c in cols)
              + f"  {', '.join(fits) or 'no'}")
        rows.append({"nodes": n, "gpus": world, **{c: plan[c] / GB for c in cols}, "fits": fits})
    if not rows:
        raise ValueError(f"ep={ep} divides none of the GPU counts {[k * gpus_per_node for k in nodes]}")
    return rows
