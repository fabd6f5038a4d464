"""Logits parity with transformers' Qwen3-MoE and GLM-4.5 (test-only dependency), both directions."""
import json

import pytest
import torch

from hf import config_from_hf, load_hf, save_hf
from model import ModelConfig, Transformer

transformers = pytest.importorskip("transformers", reason="transformers is a test-only dependency (requirements-dev.txt)")

ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def qwen3_moe():
    return transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        norm_topk_prob=True, max_position_embeddings=64, rope_parameters=dict(ROPE), initializer_range=0.2)


def glm4_moe(**kw):
    args = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                moe_intermediate_size=32, first_k_dense_replace=1, n_group=2, topk_group=1,
                routed_scaling_factor=2.5, attention_bias=True, max_position_embeddings=64,
                rope_parameters=dict(ROPE, partial_rotary_factor=0.5), initializer_range=0.2)
    args.update(kw)
    return transformers.Glm4MoeConfig(**args)


def hf_model(config):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # a non-zero selection bias, so choosing with it and weighting without it both show
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if hasattr(gate, "e_score_correction_bias"):
                gate.e_score_correction_bias.normal_(0, 0.1)
    return model


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


TOKENS = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("make", [qwen3_moe, glm4_moe, lambda: glm4_moe(use_qk_norm=True, n_group=1)],
                         ids=["qwen3_moe", "glm4_moe", "glm4_moe_qk_norm"])
@pytest.mark.parametrize("shard", [False, True], ids=["one_file", "sharded"])
def test_load_hf_gives_transformers_logits(tmp_path, make, shard):
    ref = hf_model(make())
    ref.save_pretrained(tmp_path, max_shard_size="40KB" if shard else "1GB")
    assert (tmp_path / "model.safetensors.index.json").exists() == shard
    model = load_hf(str(tmp_path)).eval()
    with torch.no_grad():
        want = ref(TOKENS).logits
        got, _ = model(TOKENS)
    assert rel_err(got, want) <= 1e-5


@pytest.mark.parametrize("make", [qwen3_moe, glm4_moe], ids=["qwen3_moe", "glm4_moe"])
def test_save_hf_loads_in_transformers_with_the_same_logits(tmp_path, make):
    torch.manual_seed(0)
    cfg = config_from_hf(make().to_dict())
    cfg.init_std = 0.2
    model = Transformer(cfg).eval()
    if cfg.router == "sigmoid":
        for layer in model.layers:
            if layer.is_moe:
                layer.mlp.expert_bias.normal_(0, 0.1)
    save_hf(model, str(tmp_path), max_shard_bytes=64 << 10)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == cfg.hf_model_type
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        assert rel_err(model(TOKENS)[0], ref(TOKENS).logits) <= 1e-5
    again = load_hf(str(tmp_path))  # and back: every tensor round-trips exactly
    for (n, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), n


def test_config_from_hf_rejects_other_model_types():
    with pytest.raises(ValueError, match="llama"):
        config_from_hf({"model_type": "llama"})


def test_saved_safetensors_get_the_umask_mode_not_0600(tmp_path):
    import os
    import stat

    cfg = ModelConfig(vocab_size=64, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8, num_experts=2, top_k=1,
                      moe_inter_dim=16, max_seq_len=16, qk_norm=True)
    save_hf(Transformer(cfg), str(tmp_path))
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(os.stat(tmp_path / "model.safetensors").st_mode) == 0o666 & ~mask
