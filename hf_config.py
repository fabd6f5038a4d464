"""An HF config.json, read into a ModelConfig and written back from one.

Each key of a Qwen3-MoE (arXiv 2505.09388) or GLM-4.5 (arXiv 2508.06471) config.json is implemented
with transformers 5.24's meaning and default (`HF_DEFAULTS`), harmless (`HF_HARMLESS`) or
implemented at one value (`HF_ONLY`); anything else is refused, so a checkpoint runs as
transformers runs it or not at all; so is a key of another type than transformers' config classes declare
(`HF_TYPES`). `read_config` reads a folder's (init_hf's shape; what hf.load_hf checks a model against,
`shape_differences`), with tie_word_embeddings resolved against the weights as transformers resolves it;
`weight_files` is which safetensors file holds each tensor; `config_to_hf` writes a config.json (hf.save_hf).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import torch

from model import HF_MODEL_TYPES, ModelConfig

HF_FAMILIES = {"qwen3_moe": "Qwen3MoeForCausalLM", "glm4_moe": "Glm4MoeForCausalLM"}
"""HF model_type -> its architectures entry in config.json (model.HF_MODEL_TYPES, in order)."""
assert tuple(HF_FAMILIES) == HF_MODEL_TYPES


# What a config.json key this file reads means when it is missing: transformers 5.24's Qwen3MoeConfig and
# Glm4MoeConfig defaults (tests/test_hf.py compares this table with those classes). head_dim None: hidden_size //
# num_attention_heads, as both families' attention derives it. rope_theta and partial_rotary_factor are the
# defaults of rope_parameters: transformers' default_theta; GLM-4.5's 0.5; Qwen3-MoE rotates whole heads.
HF_DEFAULTS = {
    "qwen3_moe": dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_attention_heads=32,
        num_key_value_heads=4, head_dim=None, hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-6,
        tie_word_embeddings=False, attention_bias=False, attention_dropout=0.0, use_sliding_window=False,
        decoder_sparse_step=1, mlp_only_layers=None, moe_intermediate_size=768, num_experts_per_tok=8,
        num_experts=128, norm_topk_prob=False, rope_theta=10000.0, partial_rotary_factor=1.0),
    "glm4_moe": dict(
        vocab_size=151552, hidden_size=4096, intermediate_size=10944, num_hidden_layers=46, num_attention_heads=96,
        num_key_value_heads=8, head_dim=None, hidden_act="silu", max_position_embeddings=131072, rms_norm_eps=1e-5,
        tie_word_embeddings=False, attention_bias=False, attention_dropout=0.0, moe_intermediate_size=1408,
        num_experts_per_tok=8, n_routed_experts=128, n_shared_experts=1, first_k_dense_replace=1,
        norm_topk_prob=True, routed_scaling_factor=1.0, n_group=1, topk_group=1, use_qk_norm=False,
        rope_theta=10000.0, partial_rotary_factor=0.5),
}
# Keys that leave the logits as they are, whatever their value: metadata, generation and cache settings, what
# outputs return, the training-only router loss, the init, classification-head keys (what to_dict() adds).
# pad_token_id is HF's embedding padding_idx, which only zeroes that row's gradient; quantization_config is how
# the weights are stored (load_hf refuses quantised weights).
HF_HARMLESS = {"transformers_version", "torch_dtype", "dtype", "use_cache", "initializer_range", "bos_token_id",
               "eos_token_id", "pad_token_id", "output_router_logits", "router_aux_loss_coef", "_name_or_path",
               "output_attentions", "output_hidden_states", "return_dict", "tokenizer_class", "quantization_config",
               "id2label", "label2id", "problem_type", "chunk_size_feed_forward", "is_encoder_decoder"}
HF_FAMILY_HARMLESS = {
    "qwen3_moe": {"sliding_window", "max_window_layers"},  # read only with use_sliding_window, which must be false
    "glm4_moe": {"num_nextn_predict_layers", "num_mtp_layers"},  # multi-token-prediction layers: load_hf skips them
}
# Keys implemented at one value only (so are architectures, the family's CausalLM, and layer_types): no GELU
# experts, no dropout, full attention in every layer, every layer MoE (HF Qwen3-MoE may interleave dense layers)
HF_ONLY = {"hidden_act": "silu", "attention_dropout": 0.0, "use_sliding_window": False, "decoder_sparse_step": 1,
           "mlp_only_layers": []}
_NUMBER = (int, float)
# Each key's type as transformers 5.24's config classes declare it: strict dataclasses, which refuse 64.0 for an int,
# 1 for a float and "64" for either (tests/test_break_hf.py holds this table to those classes). Where the default
# does not say it: head_dim is a field of neither class, but only an int builds a model; attention_dropout is
# declared float | int; rope_theta and partial_rotary_factor, which transformers moves into rope_parameters, are
# numbers there. A bool is no int here, as in neither class.
HF_TYPES = {**{k: type(v) for family in HF_DEFAULTS.values() for k, v in family.items() if v is not None},
            "head_dim": int, "mlp_only_layers": list, "num_local_experts": int, "attention_dropout": _NUMBER,
            "rope_theta": _NUMBER, "partial_rotary_factor": _NUMBER}
# rope_parameters' (or rope_scaling's) keys that take a number or null (transformers reads null as the default)
_ROPE_NUMBERS = ("rope_theta", "partial_rotary_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                 "attention_factor")
INDEX = "model.safetensors.index.json"  # a sharded checkpoint's map of tensor -> file
EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"
_TIE_ROWS = 4096  # rows of the embedding and lm_head compared at a time: 128 MiB a side at width 8192 in fp32
# rope types and the keys of rope_parameters (or rope_scaling) each reads, besides rope_theta, partial_rotary_factor
_ROPE_KEYS = {"default": set(), "linear": {"factor"},
              "yarn": {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
                       "mscale_all_dim", "attention_factor", "truncate"}}


def config_from_hf(config: str | dict) -> ModelConfig:
    """From an HF config.json (path or dict) of model_type qwen3_moe or glm4_moe, each key read as
    transformers 5.24 reads it (a missing one takes its default, `HF_DEFAULTS`).

    Raises ValueError, naming the key, its value and what is supported, on another model_type, a key
    neither implemented nor harmless (`HF_HARMLESS`), a value implemented only at another (`HF_ONLY`),
    a rope type other than default, linear and yarn, a null where transformers needs a value, a value of
    another type than transformers declares (`HF_TYPES`), or a config that is not a JSON object.
    """
    if isinstance(config, str):
        with open(config) as f:
            config = json.load(f)
    if not isinstance(config, dict):
        raise ValueError(f"{_a(type(config))}, not a JSON object of keys and values")
    c = dict(config)
    kind = c.get("model_type")
    if kind not in HF_FAMILIES:
        raise ValueError(f"model_type={kind!r} is not supported; valid: {sorted(HF_FAMILIES)}")
    defaults = HF_DEFAULTS[kind]
    known = {*defaults, *HF_HARMLESS, *HF_FAMILY_HARMLESS[kind], "model_type", "architectures", "layer_types",
             "rope_scaling", "rope_parameters", "num_local_experts"}
    unknown = sorted(set(c) - known)
    if unknown:
        raise ValueError(f"{kind} config.json keys {unknown} are not supported (neither implemented nor known to "
                         f"leave the model's function as it is); implemented: {sorted(known - HF_HARMLESS)}")
    nulls = sorted(k for k in defaults if k in c and c[k] is None and k != "mlp_only_layers")
    if nulls:
        raise ValueError(f"{kind} config.json keys {nulls} are null; each needs a value (or leave it out)")
    for k, v in c.items():
        if k in HF_TYPES and v is not None:  # a null mlp_only_layers is transformers' []; the other nulls are refused
            _check_type(f"{kind} {k}", v, HF_TYPES[k])
    for k, want in {**HF_ONLY, "architectures": [HF_FAMILIES[kind]]}.items():
        if c.get(k) not in (None, want):
            raise ValueError(f"{kind} {k}={c[k]!r} is not supported; only {want!r}")
    if any(t != "full_attention" for t in c.get("layer_types") or []):
        raise ValueError(f"layer_types={c['layer_types']!r} is not supported; only 'full_attention' layers")
    experts = "num_experts" if kind == "qwen3_moe" else "n_routed_experts"  # num_local_experts: both classes' alias
    if "num_local_experts" in c and c.get(experts, c["num_local_experts"]) != c["num_local_experts"]:
        raise ValueError(f"{experts}={c[experts]} and num_local_experts={c['num_local_experts']} disagree")
    g = {**defaults, **c, experts: c.get("num_local_experts", c.get(experts, defaults[experts]))}
    common = dict(
        vocab_size=g["vocab_size"], dim=g["hidden_size"], n_layers=g["num_hidden_layers"],
        n_heads=g["num_attention_heads"], n_kv_heads=g["num_key_value_heads"],
        head_dim=g["head_dim"] or g["hidden_size"] // g["num_attention_heads"], num_experts=g[experts],
        top_k=g["num_experts_per_tok"], moe_inter_dim=g["moe_intermediate_size"],
        dense_inter_dim=g["intermediate_size"], norm_topk_prob=g["norm_topk_prob"],
        attention_bias=g["attention_bias"], norm_eps=g["rms_norm_eps"], max_seq_len=g["max_position_embeddings"],
        tie_embeddings=g["tie_word_embeddings"], hf_model_type=kind, **_rope_from_hf(c, g, kind))
    if kind == "qwen3_moe":
        # Qwen3-MoE: q/k norm and the softmax router always; its attention_bias is on q, k, v and o
        return ModelConfig(**common, qk_norm=True, router="softmax", attention_out_bias=g["attention_bias"])
    # glm4_moe: the sigmoid router with expert bias, shared experts, dense first blocks, partial rotary
    return ModelConfig(**common, num_shared_experts=g["n_shared_experts"],
                       first_k_dense_replace=g["first_k_dense_replace"], router="sigmoid",
                       routed_scaling_factor=g["routed_scaling_factor"], n_group=g["n_group"],
                       topk_group=g["topk_group"], qk_norm=g["use_qk_norm"])


def _rope_from_hf(c: dict, g: dict, kind: str) -> dict:
    """ModelConfig's rope fields, resolved as transformers 5.24 resolves them (configuration rope
    standardisation and modeling_rope_utils). Raises ValueError on what it does not implement."""
    for key in ("rope_scaling", "rope_parameters"):
        if c.get(key) is not None:
            _check_type(f"{kind} {key}", c[key], dict)
    # rope_scaling (the older name), when set, replaces rope_parameters; rope_theta and partial_rotary_factor
    # inside it win over the top-level keys, which win over the family's defaults
    source = "rope_scaling" if c.get("rope_scaling") else "rope_parameters"
    rope = dict(c.get("rope_scaling") or c.get("rope_parameters") or {})
    for key in _ROPE_NUMBERS:
        if rope.get(key) is not None:
            _check_type(f"{kind} {source} {key}", rope[key], _NUMBER)
    if rope.get("truncate") is not None:
        _check_type(f"{kind} {source} truncate", rope["truncate"], bool)
    rope_type = rope.pop("rope_type", rope.pop("type", "default"))
    if rope_type not in _ROPE_KEYS:
        raise ValueError(f"{kind} rope_type={rope_type!r} is not supported; supported: {sorted(_ROPE_KEYS)}")
    extra = sorted(set(rope) - _ROPE_KEYS[rope_type] - {"rope_theta", "partial_rotary_factor"})
    if extra:
        raise ValueError(f"{kind} rope_type={rope_type!r} with keys {extra} is not supported; it reads "
                         f"{sorted(_ROPE_KEYS[rope_type] | {'rope_theta', 'partial_rotary_factor'})}")
    prf = rope.get("partial_rotary_factor", g["partial_rotary_factor"])
    if kind == "qwen3_moe" and prf != 1.0:  # transformers' Qwen3-MoE ignores it (default rope) or fails (scaled)
        raise ValueError(f"qwen3_moe partial_rotary_factor={prf!r} is not supported; only 1.0 (whole heads)")
    out = dict(rope_type=rope_type, rope_theta=float(rope.get("rope_theta", g["rope_theta"])),
               partial_rotary_factor=float(prf))
    if rope_type == "default":
        return out
    factor = rope.get("factor", "missing")
    if not isinstance(factor, (int, float)) and not (rope_type == "yarn" and factor is None):
        raise ValueError(f"{kind} rope_type={rope_type!r} needs a number factor; got factor={factor!r}")
    if rope_type == "linear":
        return {**out, "rope_factor": float(factor)}
    L = rope.get("original_max_position_embeddings", g["max_position_embeddings"])  # the pre-training length
    if not isinstance(L, (int, float)) or L <= 0 or L != int(L):
        raise ValueError(f"{kind} yarn original_max_position_embeddings={L!r} must be a positive integer")
    if factor is None:  # transformers: the extension ratio
        factor = g["max_position_embeddings"] / L
    scale, m, m_all = rope.get("attention_factor"), rope.get("mscale"), rope.get("mscale_all_dim")
    if scale is None and m and m_all and factor > 1:  # transformers' ratio of two YaRN scales (DeepSeek's form)
        scale = float((0.1 * m * math.log(factor) + 1.0) / (0.1 * m_all * math.log(factor) + 1.0))
    if scale is not None and not (isinstance(scale, (int, float)) and scale > 0):
        raise ValueError(f"{kind} yarn attention_factor={scale!r} is not supported; only a positive number")
    # `or 32`, `or 1`: transformers reads 0 or null as the default too
    return {**out, "rope_factor": float(factor), "rope_original_max_seq_len": int(L),
            "yarn_beta_fast": float(rope.get("beta_fast") or 32), "yarn_beta_slow": float(rope.get("beta_slow") or 1),
            "yarn_truncate": bool(rope.get("truncate", True)), "rope_attention_factor": float(scale or 0.0)}


def _a(want) -> str:
    """A JSON type's name with its article, as the errors say it: 'an int', 'a number' (int or float), 'an object'."""
    names = {int: "an int", float: "a float", bool: "a bool", str: "a str", list: "a list", dict: "an object",
             _NUMBER: "a number", type(None): "a null"}
    return names.get(want, f"a {getattr(want, '__name__', want)}")


def _check_type(key: str, value, want):
    """Raises ValueError naming key unless value is a `want` (a type or a tuple of types; a bool only for bool)."""
    if not isinstance(value, want) or (isinstance(value, bool) and want is not bool):
        raise ValueError(f"{key}={value!r} is {_a(type(value))}; transformers reads {_a(want)}")


def config_to_hf(cfg: ModelConfig) -> dict:
    """The HF config.json of a model (inverse of config_from_hf).

    Raises ValueError when the model has a feature its hf_model_type cannot express.
    """
    # what each family's config.json cannot say otherwise (Qwen3-MoE's attention_bias is q, k, v and o)
    need = (dict(router="softmax", qk_norm=True, first_k_dense_replace=0, num_shared_experts=0,
                 partial_rotary_factor=1.0, routed_scaling_factor=1.0, attention_out_bias=cfg.attention_bias)
            if cfg.hf_model_type == "qwen3_moe" else dict(router="sigmoid", attention_out_bias=False))
    wrong = {k: getattr(cfg, k) for k, v in need.items() if getattr(cfg, k) != v}
    if wrong:
        raise ValueError(f"hf_model_type={cfg.hf_model_type!r} cannot express {wrong}; it needs {need}")
    rope = dict(rope_type=cfg.rope_type, rope_theta=cfg.rope_theta)
    if cfg.hf_model_type == "glm4_moe":  # Qwen3-MoE's rope has no such key (whole heads, checked above)
        rope["partial_rotary_factor"] = cfg.partial_rotary_factor
    if cfg.rope_type != "default":
        rope["factor"] = cfg.rope_factor
    if cfg.rope_type == "yarn":
        rope.update(original_max_position_embeddings=cfg.rope_original_max_seq_len, beta_fast=cfg.yarn_beta_fast,
                    beta_slow=cfg.yarn_beta_slow, truncate=cfg.yarn_truncate)
        if cfg.rope_attention_factor:  # else transformers derives 0.1 ln s + 1, as the model does
            rope["attention_factor"] = cfg.rope_attention_factor
    # HF requires intermediate_size even without dense blocks: the expert width stands in.
    # torch_dtype is a placeholder that save_hf overwrites with the dtype it writes.
    c = dict(model_type=cfg.hf_model_type, architectures=[HF_FAMILIES[cfg.hf_model_type]],
             vocab_size=cfg.vocab_size, hidden_size=cfg.dim, num_hidden_layers=cfg.n_layers,
             num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
             num_experts_per_tok=cfg.top_k, moe_intermediate_size=cfg.moe_inter_dim,
             intermediate_size=cfg.dense_inter_dim or cfg.moe_inter_dim, norm_topk_prob=cfg.norm_topk_prob,
             attention_bias=cfg.attention_bias, rms_norm_eps=cfg.norm_eps,
             max_position_embeddings=cfg.max_seq_len, tie_word_embeddings=cfg.tie_embeddings,
             hidden_act="silu", torch_dtype="float32", rope_parameters=rope)
    if cfg.hf_model_type == "qwen3_moe":
        # every layer MoE: no interleaved dense layers
        c.update(num_experts=cfg.num_experts, decoder_sparse_step=1, mlp_only_layers=[])
    else:
        # num_nextn_predict_layers=0: GLM-4.5's multi-token-prediction layer is not part of this model
        c.update(n_routed_experts=cfg.num_experts, n_shared_experts=cfg.num_shared_experts,
                 first_k_dense_replace=cfg.first_k_dense_replace, routed_scaling_factor=cfg.routed_scaling_factor,
                 n_group=cfg.n_group, topk_group=cfg.topk_group, use_qk_norm=cfg.qk_norm, num_nextn_predict_layers=0)
    return c


def read_config(path: str) -> ModelConfig:
    """The ModelConfig of checkpoint folder `path`'s config.json (`config_from_hf`), its tie_embeddings as
    transformers decides it against the weights (`_ties`; a look at them only when config.json ties and the
    files hold an lm_head). Raises ValueError: no config.json, not JSON, not a JSON object, quantised (e4m3 values
    loaded without their scales would be silently wrong), config_from_hf's."""
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise ValueError("holds no config.json; need a hub-layout checkpoint folder (config.json, *.safetensors, "
                         "tokenizer.json)")
    try:
        with open(file, encoding="utf-8") as f:
            config = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(f"config.json is not JSON ({e})") from None
    if not isinstance(config, dict):  # here, not only in config_from_hf: it reads a str as a file's path
        raise ValueError(f"config.json: {_a(type(config))}, not a JSON object of keys and values")
    if config.get("quantization_config"):
        raise ValueError(f"config.json is quantised ({config['quantization_config']}); only unquantised weights load")
    try:
        cfg = config_from_hf(config)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"config.json: {e}") from None
    return dataclasses.replace(cfg, tie_embeddings=False) if cfg.tie_embeddings and not _ties(path) else cfg


def _ties(path: str) -> bool:
    """Whether transformers 5.24 ties the embedding and lm_head of checkpoint folder `path`, whose config.json ties
    them: yes unless its files hold both with different shapes or values (PreTrainedModel.tie_weights: "both are
    present in the checkpoints with different values, so we will NOT tie them"); with only an lm_head it ties the
    embedding to that (hf.load_hf reads it). Compared in fp32, the model's dtype, _TIE_ROWS rows at a time."""
    from safetensors import safe_open
    try:
        files = weight_files(path)
    except ValueError:  # the weights' own faults are hf.check_weights' and load_hf's to name
        return True
    if EMBED not in files or LM_HEAD not in files:
        return True
    with safe_open(os.path.join(path, files[EMBED]), "pt") as a, \
            safe_open(os.path.join(path, files[LM_HEAD]), "pt") as b:
        embed, head = a.get_slice(EMBED), b.get_slice(LM_HEAD)
        if embed.get_shape() != head.get_shape() or not embed.get_shape():
            return False
        return all(torch.equal(embed[lo:lo + _TIE_ROWS].float(), head[lo:lo + _TIE_ROWS].float())
                   for lo in range(0, embed.get_shape()[0], _TIE_ROWS))


def weight_files(path: str) -> dict[str, str]:
    """{HF tensor name: the safetensors file of checkpoint folder `path` that holds it}: the index's weight_map
    (model.safetensors.index.json), else model.safetensors's names; only headers are read. Raises ValueError
    naming the file: neither there, an index that is not JSON or maps no tensor to a file, a file it names that is
    not there or not safetensors, a tensor it puts in a file that does not hold it."""
    from safetensors import safe_open
    if os.path.isfile(os.path.join(path, INDEX)):
        try:
            with open(os.path.join(path, INDEX), encoding="utf-8") as f:
                index = json.load(f)
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"{INDEX} is not JSON ({e})") from None
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not (isinstance(weight_map, dict) and weight_map and all(isinstance(v, str) for v in weight_map.values())):
            raise ValueError(f"{INDEX} has no weight_map of tensor -> file")
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        weight_map = None
    else:
        raise ValueError(f"holds no model.safetensors or {INDEX}; need a hub-layout checkpoint folder")
    held = {}  # file -> the names its header lists
    for file in sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]:
        if not os.path.isfile(os.path.join(path, file)):
            raise ValueError(f"{file}, named in {INDEX}, is not there")
        try:
            with safe_open(os.path.join(path, file), "pt") as f:
                held[file] = set(f.keys())
        except Exception as e:  # noqa: BLE001  safetensors' SafetensorError subclasses nothing of ours
            raise ValueError(f"{file} is not a readable safetensors file ({e})") from None
    if weight_map is None:
        return dict.fromkeys(sorted(held["model.safetensors"]), "model.safetensors")
    for key, file in weight_map.items():
        if key not in held[file]:
            raise ValueError(f"{INDEX} puts {key} in {file}, which does not hold it")
    return weight_map


def shape_differences(model: ModelConfig, checkpoint: ModelConfig) -> dict:
    """{field: (model's, checkpoint's)} where a model computes another function than a checkpoint's: all but
    max_seq_len (it only bounds positions), init_std (no function), dense_inter_dim without dense blocks."""
    ignore = {"max_seq_len", "init_std"} | ({"dense_inter_dim"} if not checkpoint.first_k_dense_replace else set())
    return {k: (v, getattr(checkpoint, k)) for k, v in vars(model).items()
            if k not in ignore and getattr(checkpoint, k) != v}
