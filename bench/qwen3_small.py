"""The small Qwen3-MoE both model benchmarks use, as a transformers model and as ours with the same weights.

4 layers, hidden 256, 8 heads, 2 KV heads, head dim 32, 16 experts of 256, top-4, vocab
512 (the shape issues 3 and 4 fix), fp32, random weights under seed 0. Ours is loaded
from the transformers model's saved checkpoint with `hf.load_hf`, so both sides hold
the same numbers.
"""

from __future__ import annotations

import tempfile

import torch

from hf import load_hf
from model import Transformer


def small_qwen3_moe(max_positions: int):
    """(transformers Qwen3MoeForCausalLM, model.Transformer) with identical fp32 weights."""
    import transformers
    hf_cfg = transformers.Qwen3MoeConfig(
        vocab_size=512, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, head_dim=32, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256,
        norm_topk_prob=True, max_position_embeddings=max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
    with tempfile.TemporaryDirectory() as d:
        ref.save_pretrained(d)
        ours: Transformer = load_hf(d)
    return ref, ours
