"""Checkpoint loading proves what it loads (issue 25): each HF tensor's shape checked against config.json before
it is fused or placed, each tensor finite as it is read, embeddings tied or untied as transformers 5.24 decides,
a missing tensor or a wrong index entry named with its file, config.json's types as transformers declares them.

One table, BREAK: a row spoils one thing of a small checkpoint that transformers wrote (Qwen3-MoE or GLM-4.5,
one file or sharded) and states the outcome. "headers": hf.check_weights (what train.prepare runs before any
work) and hf.load_hf both refuse with the row's words; "values": only reading the values can show it, so
check_weights passes and load_hf refuses; "transformers": both pass and load_hf's logits are transformers'.
Before this change every row failed: shifted or truncated weights loaded silently, tracebacks (torch.cat,
torch.stack, SafetensorError), NaN and inf loaded, a tied lm_head where transformers unties it, config.json's
types refused under our field's name (dim, not hidden_size) or not at all, and check_weights passed them all.
"""

import json
import os
import re
import shutil

import pytest
import torch

import hf_config
from hf import check_weights, load_hf

transformers = pytest.importorskip("transformers", reason="a test-only dependency (requirements-dev.txt)")
from test_hf import TOKENS, glm4_moe, hf_model, qwen3_moe, rel_err  # noqa: E402  (after the importorskip)

MAKE = {"qwen3_moe": qwen3_moe, "glm4_moe": glm4_moe}
SHARD = "40KB"  # transformers' max_shard_size for the sharded sources: several files of the tiny models
NAME = "init_hf='ckpt'"  # the field check_weights' errors start with, as train.prepare passes it


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """get(family, sharded) -> a folder transformers wrote, built on first use."""
    built = {}

    def get(family: str, sharded: bool) -> str:
        if (family, sharded) not in built:
            path = str(tmp_path_factory.mktemp(f"{family}_{int(sharded)}"))
            hf_model(MAKE[family]()).save_pretrained(path, max_shard_size=SHARD if sharded else "1GB")
            built[family, sharded] = path
        return built[family, sharded]
    return get


# ------------------------------------------------ what a row does to its copy of the folder

def index_of(path: str) -> dict | None:
    file = os.path.join(path, "model.safetensors.index.json")
    return json.load(open(file)) if os.path.exists(file) else None


def file_of(path: str, key: str) -> str:
    index = index_of(path)
    return index["weight_map"][key] if index else "model.safetensors"


def edit_file(path: str, file: str, edit):
    """File `file` of the folder rewritten with edit(its tensors) applied."""
    from safetensors.torch import load_file, save_file
    tensors = load_file(os.path.join(path, file))
    edit(tensors)
    save_file(tensors, os.path.join(path, file), metadata={"format": "pt"})


def reshape(key: str, *shape: int):
    """key holds random numbers of another shape."""
    def spoil(path):
        edit_file(path, file_of(path, key), lambda ts: ts.update({key: torch.randn(shape)}))
    return spoil


def poison(key: str, value: float):
    """One entry of key (its last) is value: NaN or inf."""
    def spoil(path):
        edit_file(path, file_of(path, key), lambda ts: ts[key].view(-1)[-1].fill_(value))
    return spoil


def drop(key: str, *, from_index: bool = True):
    """key is gone from its file (and, from_index, from the index too)."""
    def spoil(path):
        edit_file(path, file_of(path, key), lambda ts: ts.pop(key))
        index = index_of(path)
        if index and from_index:
            del index["weight_map"][key]
            json.dump(index, open(os.path.join(path, "model.safetensors.index.json"), "w"))
    return spoil


def misfile(key: str):
    """The index puts key in another shard (the first that does not hold it)."""
    def spoil(path):
        index = index_of(path)
        index["weight_map"][key] = next(f for f in sorted(set(index["weight_map"].values()))
                                        if f != index["weight_map"][key])
        json.dump(index, open(os.path.join(path, "model.safetensors.index.json"), "w"))
    return spoil


def config(**changes):
    def spoil(path):
        file = os.path.join(path, "config.json")
        c = json.load(open(file))
        for k, v in changes.items():
            c[k] = {**c[k], **v} if isinstance(v, dict) and isinstance(c.get(k), dict) else v
        json.dump(c, open(file, "w"))
    return spoil


def config_text(text: str):
    return lambda path: open(os.path.join(path, "config.json"), "w").write(text)


def untie(path):
    """config.json ties the embedding and the lm_head, the files hold a distinct lm_head (transformers: untied)."""
    config(tie_word_embeddings=True)(path)


def tie_to_lm_head(path):
    """config.json ties them and the files hold only lm_head.weight (transformers ties the embedding to it)."""
    untie(path)
    drop("model.embed_tokens.weight")(path)


def shape_error(key: str, file: str, found: tuple, want: tuple) -> str:
    return re.escape(f"{key} in {file} has shape {found}; config.json gives it {want}")


def row(family, spoil, outcome, words="", *, sharded=False, id):
    return pytest.param(family, sharded, spoil, outcome, words, id=id)


Q, G = "qwen3_moe", "glm4_moe"
L0, L1, L2 = "model.layers.0.", "model.layers.1.", "model.layers.2."
ONE = "model.safetensors"
SHARD_FILE = r"model-\d{5}-of-\d{5}\.safetensors"

BREAK = [
    # ------------------------------------------------ a tensor of another shape than config.json gives it
    row(Q, reshape(L0 + "self_attn.q_proj.weight", 65, 64), "headers",
        shape_error(L0 + "self_attn.q_proj.weight", ONE, (65, 64), (64, 64)), id="q_proj-a-row-more"),
    row(Q, reshape(L0 + "self_attn.q_proj.weight", 64, 63), "headers",
        shape_error(L0 + "self_attn.q_proj.weight", ONE, (64, 63), (64, 64)), id="q_proj-a-column-less"),
    row(Q, reshape(L1 + "mlp.experts.3.gate_proj.weight", 33, 64), "headers",
        shape_error(L1 + "mlp.experts.3.gate_proj.weight", ONE, (33, 64), (32, 64)), id="expert-gate_proj-a-row-more"),
    row(Q, reshape(L1 + "mlp.experts.7.down_proj.weight", 64, 31), "headers",
        shape_error(L1 + "mlp.experts.7.down_proj.weight", ONE, (64, 31), (64, 32)), id="expert-down_proj-narrow"),
    row(Q, reshape(L0 + "mlp.gate.weight", 9, 64), "headers",
        shape_error(L0 + "mlp.gate.weight", ONE, (9, 64), (8, 64)), id="router-an-expert-more"),
    row(Q, reshape(L1 + "input_layernorm.weight", 65), "headers",
        shape_error(L1 + "input_layernorm.weight", ONE, (65,), (64,)), id="norm-longer"),
    row(Q, reshape("lm_head.weight", 129, 64), "headers",
        shape_error("lm_head.weight", ONE, (129, 64), (128, 64)), id="lm_head-a-row-more"),
    row(G, reshape(L0 + "self_attn.q_proj.bias", 65), "headers",
        shape_error(L0 + "self_attn.q_proj.bias", ONE, (65,), (64,)), id="glm-q_bias-longer"),
    row(G, reshape(L0 + "mlp.gate_proj.weight", 97, 64), "headers",
        shape_error(L0 + "mlp.gate_proj.weight", ONE, (97, 64), (96, 64)), id="glm-dense-gate_proj"),
    row(G, reshape(L1 + "mlp.shared_experts.up_proj.weight", 33, 64), "headers",
        shape_error(L1 + "mlp.shared_experts.up_proj.weight", ONE, (33, 64), (32, 64)), id="glm-shared-up_proj"),
    row(G, reshape(L2 + "mlp.experts.0.up_proj.weight", 32, 65), "headers",
        shape_error(L2 + "mlp.experts.0.up_proj.weight", ONE, (32, 65), (32, 64)), id="glm-expert-up_proj-wide"),
    row(G, reshape(L1 + "mlp.gate.e_score_correction_bias", 9), "headers",
        shape_error(L1 + "mlp.gate.e_score_correction_bias", ONE, (9,), (8,)), id="glm-expert-bias-longer"),
    row(G, reshape(L2 + "mlp.experts.5.gate_proj.weight", 31, 64), "headers",
        shape_error(L2 + "mlp.experts.5.gate_proj.weight", "FILE", (31, 64), (32, 64)).replace("FILE", SHARD_FILE),
        sharded=True, id="glm-sharded-expert-names-its-shard"),
    # ------------------------------------------------ a tensor missing, or the index pointing at the wrong shard
    row(Q, drop(L1 + "self_attn.k_proj.weight"), "headers",
        re.escape(f"{L1}self_attn.k_proj.weight is missing: {ONE} does not hold it"), id="k_proj-missing"),
    row(G, drop(L2 + "mlp.experts.6.down_proj.weight"), "headers",
        re.escape(f"{L2}mlp.experts.6.down_proj.weight is missing: model.safetensors.index.json does not name it"),
        sharded=True, id="glm-sharded-expert-missing-from-the-index"),
    row(G, drop(L1 + "mlp.gate.weight", from_index=False), "headers",
        re.escape(f"model.safetensors.index.json puts {L1}mlp.gate.weight in ") + SHARD_FILE
        + re.escape(", which does not hold it"), sharded=True, id="glm-sharded-index-names-a-shard-without-it"),
    row(Q, misfile(L0 + "self_attn.o_proj.weight"), "headers",
        re.escape(f"model.safetensors.index.json puts {L0}self_attn.o_proj.weight in ") + SHARD_FILE
        + re.escape(", which does not hold it"), sharded=True, id="sharded-index-names-another-shard"),
    # ------------------------------------------------ NaN or inf: named with the tensor and its file
    row(G, poison(L1 + "mlp.gate.e_score_correction_bias", float("nan")), "values",
        re.escape(f"{L1}mlp.gate.e_score_correction_bias in {ONE} holds NaN or inf"), id="glm-expert-bias-nan"),
    row(Q, poison("model.norm.weight", float("nan")), "values",
        re.escape(f"model.norm.weight in {ONE} holds NaN or inf"), id="final-norm-nan"),
    row(Q, poison(L1 + "mlp.experts.2.down_proj.weight", float("inf")), "values",
        re.escape(f"{L1}mlp.experts.2.down_proj.weight in ") + SHARD_FILE + " holds NaN or inf", sharded=True,
        id="sharded-expert-inf-names-its-shard"),
    row(G, poison(L0 + "self_attn.v_proj.bias", float("-inf")), "values",
        re.escape(f"{L0}self_attn.v_proj.bias in {ONE} holds NaN or inf"), id="glm-v_bias-minus-inf"),
    # ------------------------------------------------ tie_word_embeddings against what the files hold
    row(Q, untie, "transformers", id="tied-config-distinct-lm_head-is-untied"),
    row(G, untie, "transformers", sharded=True, id="glm-sharded-tied-config-distinct-lm_head-is-untied"),
    row(Q, tie_to_lm_head, "transformers", id="tied-config-only-lm_head-ties-to-it"),
    # ------------------------------------------------ config.json: an object, each key of transformers' type
    row(Q, config_text("[1, 2]"), "headers", re.escape("config.json: a list, not a JSON object"),
        id="config-a-list"),
    row(Q, config_text('"qwen3_moe"'), "headers", re.escape("config.json: a str, not a JSON object"),
        id="config-a-string"),
    row(Q, config(hidden_size="64"), "headers",
        re.escape("config.json: qwen3_moe hidden_size='64' is a str; transformers reads an int"), id="hidden_size-str"),
    row(G, config(n_routed_experts=8.0), "headers",
        re.escape("config.json: glm4_moe n_routed_experts=8.0 is a float; transformers reads an int"),
        id="glm-experts-float"),
    row(Q, config(rms_norm_eps="1e-6"), "headers",
        re.escape("config.json: qwen3_moe rms_norm_eps='1e-6' is a str; transformers reads a float"),
        id="rms_norm_eps-str"),
    row(Q, config(tie_word_embeddings="false"), "headers",
        re.escape("config.json: qwen3_moe tie_word_embeddings='false' is a str; transformers reads a bool"),
        id="tie_word_embeddings-str"),
    row(Q, config(rope_parameters={"rope_theta": "10000"}), "headers",
        re.escape("config.json: qwen3_moe rope_parameters rope_theta='10000' is a str; transformers reads a number"),
        id="rope_theta-str"),
    row(G, config(rope_parameters={"partial_rotary_factor": "0.5"}), "headers",
        re.escape("config.json: glm4_moe rope_parameters partial_rotary_factor='0.5' is a str; transformers reads a "
                  "number"), id="glm-partial_rotary_factor-str"),
    row(G, config(rope_parameters=[10000.0]), "headers",
        re.escape("config.json: glm4_moe rope_parameters=[10000.0] is a list; transformers reads an object"),
        id="glm-rope_parameters-a-list"),
]


@pytest.mark.parametrize("family, sharded, spoil, outcome, words", BREAK)
def test_a_spoiled_checkpoint_is_refused_naming_it_or_loads_as_transformers_does(
        family, sharded, spoil, outcome, words, sources, tmp_path):
    path = str(tmp_path / "ckpt")
    shutil.copytree(sources(family, sharded), path)
    spoil(path)
    if outcome == "headers":  # before any work: the files' headers and config.json show it
        with pytest.raises(ValueError) as e:
            check_weights(NAME, path)
        assert str(e.value).startswith(f"{NAME}: ") and re.search(words, str(e.value)), str(e.value)
    else:
        check_weights(NAME, path)
    if outcome == "transformers":
        ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        model = load_hf(path).eval()
        with torch.no_grad():
            assert rel_err(model(TOKENS)[0], ref(TOKENS).logits) <= 1e-5
        assert (model.lm_head.weight is model.embed.weight) == (ref.lm_head.weight is ref.model.embed_tokens.weight)
        return
    with pytest.raises(ValueError) as e:
        load_hf(path)
    assert str(e.value).startswith(f"load_hf: {path}: ") and re.search(words, str(e.value)), str(e.value)
    assert "\n" not in str(e.value)


def test_the_checkpoints_the_rows_spoil_pass_every_check(sources):
    """So each row fails for what it spoils."""
    for family in MAKE:
        for sharded in (False, True):
            check_weights(NAME, sources(family, sharded))
            load_hf(sources(family, sharded))


def test_a_tied_config_whose_files_hold_an_equal_lm_head_loads_tied_as_transformers_does(sources, tmp_path, capsys):
    """The other side of the untied rows (these files load tied before and after this change)."""
    path = str(tmp_path / "ckpt")
    shutil.copytree(sources("qwen3_moe", False), path)
    untie(path)
    edit_file(path, ONE, lambda ts: ts.update({"lm_head.weight": ts["model.embed_tokens.weight"].clone()}))
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = load_hf(path).eval()
    with torch.no_grad():
        assert rel_err(model(TOKENS)[0], ref(TOKENS).logits) <= 1e-5
    assert model.lm_head.weight is model.embed.weight and ref.lm_head.weight is ref.model.embed_tokens.weight
    assert "skipped" not in capsys.readouterr().out  # its lm_head is read: it is the embedding


@pytest.mark.parametrize("family", MAKE)
def test_each_key_takes_the_type_transformers_config_class_declares(family):
    import dataclasses
    cls = {"qwen3_moe": transformers.Qwen3MoeConfig, "glm4_moe": transformers.Glm4MoeConfig}[family]
    declared = {f.name: f.type for f in dataclasses.fields(cls)}
    for key in hf_config.HF_DEFAULTS[family]:
        if declared.get(key) in (int, float, bool, str):  # one plain type; the rest are checked by hand in BREAK
            assert hf_config.HF_TYPES[key] is declared[key], key


def test_train_refuses_a_misshapen_tensor_before_any_work(tmp_path, monkeypatch):
    """The run's path (train.py's __main__: parse_args, then train.main, whose first act is train.prepare): a
    checkpoint whose q_proj has a row too many stops there, as a config error naming the field and the tensor."""
    import train
    from config import ConfigError, load_config, parse_args
    from hf import save_hf
    from model import Transformer
    from runs import MICRO
    from tokenizer import build_tokenizer, demo_tokenizer
    (tmp_path / "micro.py").write_text(MICRO)
    cfg = load_config(str(tmp_path / "micro.py"), [])
    ckpt = str(tmp_path / "ckpt")
    save_hf(Transformer(cfg.model), ckpt)
    demo_tokenizer(build_tokenizer(cfg.model.vocab_size)).save(ckpt)
    reshape("model.layers.1.self_attn.q_proj.weight", 33, 32)(ckpt)
    monkeypatch.setattr(train, "run", lambda *a, **kw: pytest.fail("train.run started: the checkpoint was not refused"))
    with pytest.raises(ConfigError, match=re.escape(f"init_from={ckpt!r}: model.layers.1.self_attn.q_proj.weight in "
                                                    f"model.safetensors has shape (33, 32); config.json gives it (32, 32)")):
        train.main(parse_args([str(tmp_path / "micro.py"), f"out_dir={tmp_path / 'run'}", f"init_from={ckpt}",
                               "model.max_seq_len=256"]))
    assert not (tmp_path / "run").exists()
