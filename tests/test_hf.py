"""Logits parity with transformers' Qwen3-MoE and GLM-4.5 (test-only dependency), both directions; config.json
keys implemented as transformers 5.24 reads them or refused; save_hf's streaming writes."""
import dataclasses
import json
import os
import re
import socket

import pytest
import torch
import torch.multiprocessing as mp

import hf
from hf import load_hf, save_hf
from hf_config import HF_DEFAULTS, config_from_hf, config_to_hf
from model import ModelConfig, Transformer, rope, rope_frequencies
from weights import policy_tensors

transformers = pytest.importorskip("transformers", reason="transformers is a test-only dependency (requirements-dev.txt)")

ROPE = {"rope_type": "default", "rope_theta": 10000.0}
# L = 8 positions of pre-training, s = 4: TOKENS' 17 positions run past L, and every dim but the fastest is
# interpolated, so YaRN's frequencies and its cos/sin scale (1 + 0.1 ln 4) both show in the logits
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8}


def qwen3_moe(**kw):
    args = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                norm_topk_prob=True, max_position_embeddings=64, rope_parameters=dict(ROPE), initializer_range=0.2)
    args.update(kw)
    return transformers.Qwen3MoeConfig(**args)


def glm4_moe(**kw):
    args = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                moe_intermediate_size=32, first_k_dense_replace=1, n_group=2, topk_group=1,
                routed_scaling_factor=2.5, attention_bias=True, max_position_embeddings=64,
                rope_parameters=dict(ROPE, partial_rotary_factor=0.5), initializer_range=0.2)
    args.update(kw)
    return transformers.Glm4MoeConfig(**args)


FAMILIES = {"qwen3_moe": qwen3_moe, "glm4_moe": glm4_moe}
NEW_FEATURES = {  # tied embeddings, attention bias (Qwen3-MoE's on q, k, v and o), YaRN
    "qwen3_moe_tied_bias_yarn": lambda: qwen3_moe(tie_word_embeddings=True, attention_bias=True,
                                                  rope_parameters=dict(YARN)),
    "glm4_moe_tied_bias_yarn": lambda: glm4_moe(tie_word_embeddings=True,
                                                rope_parameters=dict(YARN, partial_rotary_factor=0.5)),
}


def hf_model(config):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # a non-zero selection bias, so choosing with it and weighting without it both show
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if hasattr(gate, "e_score_correction_bias"):
                gate.e_score_correction_bias.normal_(0, 0.1)
        for name, p in model.named_parameters():  # transformers inits biases to zero, which would hide a lost one
            if name.endswith(".bias"):
                p.normal_(0, 0.5)
    return model


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


TOKENS = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("make", [qwen3_moe, glm4_moe, lambda: glm4_moe(use_qk_norm=True, n_group=1),
                                  lambda: qwen3_moe(norm_topk_prob=False,  # Qwen3-MoE's default
                                                    rope_parameters={"rope_type": "linear", "factor": 2.5}),
                                  *NEW_FEATURES.values()],
                         ids=["qwen3_moe", "glm4_moe", "glm4_moe_qk_norm", "qwen3_moe_linear_unnormalised",
                              *NEW_FEATURES])
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
    assert (model.lm_head.weight is model.embed.weight) == ref.config.tie_word_embeddings


@pytest.mark.parametrize("make", [qwen3_moe, glm4_moe, *NEW_FEATURES.values()], ids=[*FAMILIES, *NEW_FEATURES])
def test_save_hf_loads_in_transformers_and_in_load_hf_with_the_same_logits(tmp_path, make):
    torch.manual_seed(0)
    cfg = config_from_hf(make().to_dict())
    cfg.init_std = 0.2
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)
        if cfg.router == "sigmoid":
            for layer in model.layers:
                if layer.is_moe:
                    layer.mlp.expert_bias.normal_(0, 0.1)
    save_hf(model, str(tmp_path), max_shard_bytes=64 << 10)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == cfg.hf_model_type
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    again = load_hf(str(tmp_path)).eval()  # and back: every tensor round-trips exactly
    with torch.no_grad():
        want = model(TOKENS)[0]
        assert rel_err(want, ref(TOKENS).logits) <= 1e-5
        assert torch.equal(again(TOKENS)[0], want)
    assert again.cfg == dataclasses.replace(cfg, init_std=ModelConfig.init_std)
    for (n, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), n


ROTARY = {"qwen3_moe": "qwen3_moe.modeling_qwen3_moe.Qwen3MoeRotaryEmbedding",
          "glm4_moe": "glm4_moe.modeling_glm4_moe.Glm4MoeRotaryEmbedding"}


@pytest.mark.parametrize("rope_parameters", [
    dict(rope_type="default"), dict(rope_type="linear", factor=2.5), dict(YARN),
    dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=32, beta_fast=16, beta_slow=2, truncate=False),
    dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=8, attention_factor=0.8),
    dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=8, mscale=0.707, mscale_all_dim=1.0),
    dict(rope_type="yarn", factor=None, original_max_position_embeddings=16),  # s = max_position_embeddings / L
    dict(rope_type="yarn", factor=2.0),  # L defaults to max_position_embeddings
], ids=["default", "linear", "yarn", "yarn_betas_untruncated", "yarn_attention_factor", "yarn_mscale",
        "yarn_implicit_factor", "yarn_implicit_original"])
@pytest.mark.parametrize("family", FAMILIES)
def test_rope_frequencies_cos_and_sin_equal_transformers_bit_for_bit(family, rope_parameters):
    import importlib
    module, cls = ROTARY[family].rsplit(".", 1)
    hf_cfg = FAMILIES[family](rope_parameters=dict(rope_parameters, rope_theta=500.0))
    rotary = getattr(importlib.import_module(f"transformers.models.{module}"), cls)(hf_cfg)
    cfg = config_from_hf(hf_cfg.to_dict())
    inv_freq, scale = rope_frequencies(cfg, "cpu")
    assert torch.equal(inv_freq, rotary.inv_freq) and scale == rotary.attention_scaling
    pos = torch.arange(40).expand(2, 40)
    want_cos, want_sin = rotary(torch.zeros(1), pos)
    got_cos, got_sin = rope(pos, cfg)
    assert torch.equal(got_cos, want_cos) and torch.equal(got_sin, want_sin)


@pytest.mark.parametrize("family", FAMILIES)
def test_defaults_table_is_transformers_config_class_defaults(family):
    ref = {"qwen3_moe": transformers.Qwen3MoeConfig, "glm4_moe": transformers.Glm4MoeConfig}[family]()
    for key, want in HF_DEFAULTS[family].items():
        if key in ("rope_theta", "partial_rotary_factor"):  # nested in rope_parameters; Qwen3's rotates whole heads
            got = ref.rope_parameters.get(key, 1.0)
        elif key == "head_dim":  # neither class has one: hidden_size // num_attention_heads
            got = getattr(ref, key, None)
        elif key == "mlp_only_layers":  # Qwen3MoeConfig turns its None into []
            got, want = ref.mlp_only_layers, want or []
        else:
            got = getattr(ref, key)
        assert got == want and type(got) is type(want), (key, got, want)
    # a config.json of only its model_type means what transformers' defaults mean (GLM-4.5's default heads,
    # 4096 / 96 = 42 wide, would rotate an odd 21 dims, which neither model implements: a real head_dim here)
    extra = {"head_dim": 128} if family == "glm4_moe" else {}
    assert config_from_hf({"model_type": family, **extra}) == config_from_hf(type(ref)(**extra).to_dict())


QWEN3_30B_A3B = dict(  # the key set and values of Qwen/Qwen3-30B-A3B's config.json
    architectures=["Qwen3MoeForCausalLM"], attention_bias=False, attention_dropout=0.0, bos_token_id=151643,
    decoder_sparse_step=1, eos_token_id=151645, head_dim=128, hidden_act="silu", hidden_size=2048,
    initializer_range=0.02, intermediate_size=6144, max_position_embeddings=40960, max_window_layers=48,
    mlp_only_layers=[], model_type="qwen3_moe", moe_intermediate_size=768, norm_topk_prob=True, num_attention_heads=32,
    num_experts=128, num_experts_per_tok=8, num_hidden_layers=48, num_key_value_heads=4, output_router_logits=False,
    rms_norm_eps=1e-06, rope_scaling=None, rope_theta=1000000.0, router_aux_loss_coef=0.001, sliding_window=None,
    tie_word_embeddings=False, torch_dtype="bfloat16", transformers_version="4.51.0", use_cache=True,
    use_sliding_window=False, vocab_size=151936)
GLM_45_AIR = dict(  # the key set and values of zai-org/GLM-4.5-Air's config.json
    architectures=["Glm4MoeForCausalLM"], attention_bias=True, attention_dropout=0.0, pad_token_id=151329,
    eos_token_id=[151329, 151336, 151338], head_dim=128, hidden_act="silu", hidden_size=4096, partial_rotary_factor=0.5,
    initializer_range=0.02, intermediate_size=10944, max_position_embeddings=131072, model_type="glm4_moe",
    moe_intermediate_size=1408, norm_topk_prob=True, num_attention_heads=96, n_group=1, topk_group=1,
    n_routed_experts=128, n_shared_experts=1, routed_scaling_factor=1.0, num_experts_per_tok=8, first_k_dense_replace=1,
    num_hidden_layers=46, num_key_value_heads=8, rms_norm_eps=1e-05, rope_scaling=None, rope_theta=1000000,
    num_nextn_predict_layers=1, tie_word_embeddings=False, torch_dtype="bfloat16", transformers_version="4.54.0",
    use_cache=True, use_qk_norm=False, vocab_size=151552)


def test_real_qwen3_and_glm45_configs_load_as_transformers_reads_them():
    q = config_from_hf(QWEN3_30B_A3B)
    assert (q.head_dim, q.rope_theta, q.norm_topk_prob, q.qk_norm, q.max_seq_len) == (128, 1e6, True, True, 40960)
    assert (q.rope_type, q.attention_bias, q.attention_out_bias, q.num_experts, q.router) == (
        "default", False, False, 128, "softmax")
    g = config_from_hf(GLM_45_AIR)
    assert (g.head_dim, g.rotary_dim, g.num_shared_experts, g.first_k_dense_replace, g.dense_inter_dim) == (
        128, 64, 1, 1, 10944)
    assert (g.attention_bias, g.attention_out_bias, g.rope_theta, g.norm_eps, g.router) == (
        True, False, 1e6, 1e-5, "sigmoid")
    # Qwen3's long-context recipe: YaRN over its 32768 pre-training positions
    y = config_from_hf({**QWEN3_30B_A3B, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                          "original_max_position_embeddings": 32768}})
    assert (y.rope_type, y.rope_factor, y.rope_original_max_seq_len, y.rope_theta) == ("yarn", 4.0, 32768, 1e6)


@pytest.mark.parametrize("cfg", [
    ModelConfig(qk_norm=True, attention_bias=True, attention_out_bias=True, tie_embeddings=True, dense_inter_dim=96,
                rope_type="yarn",
                rope_factor=4.0, rope_original_max_seq_len=256, yarn_beta_fast=16.0, yarn_beta_slow=2.0,
                yarn_truncate=False, rope_attention_factor=0.9),
    ModelConfig(router="sigmoid", hf_model_type="glm4_moe", attention_bias=True, partial_rotary_factor=0.5,
                first_k_dense_replace=1, dense_inter_dim=96, num_shared_experts=1, rope_type="linear",
                rope_factor=2.0),
], ids=["qwen3_moe_yarn", "glm4_moe_linear"])
def test_config_round_trips_through_config_json(cfg):
    assert config_from_hf(json.loads(json.dumps(config_to_hf(cfg)))) == cfg


def tiny_hf(family):
    return FAMILIES[family]().to_dict()


@pytest.mark.parametrize("family, patch, match", [
    ("qwen3_moe", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("glm4_moe", {"hidden_act": "relu2"}, "hidden_act='relu2'"),
    ("qwen3_moe", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type='dynamic'"),
    ("glm4_moe", {"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}},
     "rope_type='longrope'"),
    ("qwen3_moe", {"rope_parameters": {"type": "llama3", "factor": 8.0}}, "rope_type='llama3'"),
    ("qwen3_moe", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "low_freq_factor": 1.0}},
     "low_freq_factor"),
    ("qwen3_moe", {"rope_parameters": {"rope_type": "linear"}}, "factor"),
    ("qwen3_moe", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "attention_factor": 0.0}},
     "attention_factor=0.0"),
    ("qwen3_moe", {"attention_dropout": 0.1}, "attention_dropout=0.1"),
    ("qwen3_moe", {"use_sliding_window": True}, "use_sliding_window=True"),
    ("qwen3_moe", {"mlp_only_layers": [1]}, "mlp_only_layers=[1]"),
    ("qwen3_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
    ("qwen3_moe", {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ("glm4_moe", {"use_sliding_window": False}, "use_sliding_window"),  # not a GLM-4.5 key
    ("glm4_moe", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ("qwen3_moe", {"head_dim": None}, "head_dim"),
    ("qwen3_moe", {"architectures": ["Qwen3MoeForSequenceClassification"]}, "architectures"),
    ("glm4_moe", {"layer_types": ["full_attention", "sliding_attention", "full_attention"]}, "layer_types"),
    ("qwen3_moe", {"num_local_experts": 8, "num_experts": 16}, "num_local_experts=8"),
])
def test_config_from_hf_refuses_what_it_does_not_implement_naming_the_key(family, patch, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        config_from_hf({**tiny_hf(family), **patch})


def test_config_from_hf_rejects_other_model_types():
    with pytest.raises(ValueError, match="llama"):
        config_from_hf({"model_type": "llama"})


@pytest.mark.parametrize("family, fields", [("qwen3_moe", dict(qk_norm=True, attention_bias=True)),
                                            ("glm4_moe", dict(router="sigmoid", attention_out_bias=True))])
def test_config_to_hf_refuses_an_output_bias_the_family_cannot_express(family, fields):
    with pytest.raises(ValueError, match="attention_out_bias"):
        config_to_hf(ModelConfig(hf_model_type=family, **fields))


def small(**kw):
    return ModelConfig(**{**dict(vocab_size=64, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8, num_experts=2,
                                 top_k=1, norm_topk_prob=False, moe_inter_dim=16, max_seq_len=16, qk_norm=True),
                              **kw})


def test_load_hf_refuses_a_quantised_checkpoint_and_a_model_of_another_config(tmp_path):
    save_hf(Transformer(small()), str(tmp_path / "fp8"), fp8=True)
    with pytest.raises(ValueError, match="quantised"):
        load_hf(str(tmp_path / "fp8"))
    save_hf(Transformer(small()), str(tmp_path / "plain"))
    load_hf(str(tmp_path / "plain"), Transformer(small(max_seq_len=8)))  # a shorter context is the same function
    with pytest.raises(ValueError, match="rope_theta"):
        load_hf(str(tmp_path / "plain"), Transformer(small(rope_theta=500.0)))


def test_load_hf_reads_nothing_for_a_rank_holding_no_rows_of_a_tensor(tmp_path):
    src = Transformer(small())
    save_hf(src, str(tmp_path))
    dst = Transformer(small())
    # an uneven FSDP shard: this rank's slice of the final norm starts at its end and holds no rows
    dst.norm.weight = torch.nn.Parameter(torch.empty(0))
    load_hf(str(tmp_path), dst, offsets={"norm.weight": (16,)})
    for name, t in src.state_dict().items():
        assert name == "norm.weight" or torch.equal(dst.state_dict()[name], t), name


def test_save_hf_writes_each_shard_before_it_gathers_the_rest(tmp_path, monkeypatch):
    import safetensors.torch
    events, gather, write = [], hf.full_tensor, safetensors.torch.save_file
    monkeypatch.setattr(hf, "full_tensor", lambda t: events.append("gather") or gather(t))
    monkeypatch.setattr(safetensors.torch, "save_file", lambda *a, **kw: events.append("write") or write(*a, **kw))
    model = Transformer(small(n_layers=2))
    save_hf(model, str(tmp_path), max_shard_bytes=4 << 10)
    assert events.count("gather") == len(list(policy_tensors(model)))
    assert events.count("write") > 2 and events.index("write") < len(events) - 1 - events[::-1].index("gather")
    n = events.count("write")
    shards = [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert sorted(os.listdir(tmp_path)) == sorted([*shards, "model.safetensors.index.json", "config.json"])
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    save_hf(model, str(tmp_path))  # again, in one file: the old shards and index go
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    assert torch.equal(load_hf(str(tmp_path))(TOKENS[:, :8] % 64)[0], model(TOKENS[:, :8] % 64)[0])


def test_save_hf_on_a_rank_that_does_not_write_takes_part_in_every_gather_and_writes_nothing(tmp_path, monkeypatch):
    gathered, gather = [], hf.full_tensor
    monkeypatch.setattr(hf, "full_tensor", lambda t: gathered.append(t) or gather(t))
    model = Transformer(small())
    save_hf(model, str(tmp_path / "out"), write=False)
    assert len(gathered) == len(list(policy_tensors(model))) and not (tmp_path / "out").exists()


def test_saved_safetensors_get_the_umask_mode_not_0600(tmp_path):
    import stat

    save_hf(Transformer(small()), str(tmp_path))
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(os.stat(tmp_path / "model.safetensors").st_mode) == 0o666 & ~mask


# 2 ranks, FSDP x EP = 2: each reads its slices of a checkpoint, then both save it back, rank 0 writing
SHARDED = dict(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8, num_experts=4, top_k=2,
               moe_inter_dim=16, num_shared_experts=1, first_k_dense_replace=1, dense_inter_dim=24, router="sigmoid",
               n_group=2, topk_group=2, qk_norm=True, attention_bias=True, partial_rotary_factor=0.5,
               hf_model_type="glm4_moe", max_seq_len=64, rope_type="yarn", rope_factor=4.0,
               rope_original_max_seq_len=16)


def save_worker(rank, world, port, src, dst):
    import torch.distributed as dist

    import distributed
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        with torch.device("meta"):
            model = Transformer(ModelConfig(**SHARDED))
        distributed.parallelize(model, distributed.build_meshes(world, 2))
        model.to_empty(device="cpu")
        load_hf(src, model, offsets=distributed.shard_offsets(model))
        save_hf(model, dst, write=rank == 0, max_shard_bytes=16 << 10)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_rank_save_hf_writes_the_one_process_checkpoint(tmp_path):
    from safetensors.torch import load_file
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**SHARDED))
    save_hf(model, str(tmp_path / "one"), max_shard_bytes=16 << 10)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(save_worker, args=(2, port, str(tmp_path / "one"), str(tmp_path / "two")), nprocs=2,
                       join=True, start_method="spawn")
    one, two = sorted(os.listdir(tmp_path / "one")), sorted(os.listdir(tmp_path / "two"))
    assert one == two and len(one) > 3  # sharded, with the index and config.json
    for f in one:
        if f.endswith(".safetensors"):
            a, b = load_file(tmp_path / "one" / f), load_file(tmp_path / "two" / f)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f
        else:
            assert (tmp_path / "one" / f).read_text() == (tmp_path / "two" / f).read_text()
