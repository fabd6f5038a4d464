"""HF checkpoints: model.Transformer in and out of the hub's safetensors layout.

`load_hf(path)` reads config.json (`config_from_hf`) and the safetensors files, one or
sharded with model.safetensors.index.json, lazily with `safe_open`, and a parallelized model
reads only its local shard (`Transformer.local_offsets`), never the full tensor.
`save_hf(model, path)` writes the reverse (HF names, split and transposed back) plus
config.json, loadable by transformers and SGLang; `hf_tensors` is the same conversion as a
stream, which SGLang's weight sync also sends. The name map `_HF_RENAMES` covers Qwen3-MoE
(arXiv 2505.09388) and GLM-4.5 (arXiv 2508.06471); the FP8 variant is DeepSeek-V3's
blockwise format (arXiv 2412.19437). Raises ValueError on a missing tensor or a shape that
does not match.
Shapes: E, D, I, H, J, d (letters of the README's legend).

How our tensors map to HF's:
1. Fused weights concatenate HF's: q|k|v along the rows of our wqkv (weight and bias), gate|up
   along the rows of a dense or shared w13, and gate|up along the last dim of the stacked
   experts' w13 [E, D, 2I].
2. Stacked experts are one tensor per projection ([E, D, 2I], [E, I, D], each expert's matrix
   [in, out]); HF has one key per expert and projection, [out, in]: transposed both ways.
3. GLM-4.5's expert bias is HF's `mlp.gate.e_score_correction_bias`; the softmax router has
   none in a checkpoint and loads as zero.
4. Checkpoint tensors the model has no place for (e.g. GLM-4.5's multi-token-prediction
   layers) are skipped, counted and named in one line.
"""

from __future__ import annotations

import json
import os
import re

import torch

from model import HF_MODEL_TYPES, ModelConfig, Transformer
from rollout import full_tensor, policy_tensors


# re.fullmatch against our whole name: no pattern matches a name another one does, so the order is free
HF_FAMILIES = {"qwen3_moe": "Qwen3MoeForCausalLM", "glm4_moe": "Glm4MoeForCausalLM"}
"""HF model_type -> its architectures entry in config.json (model.HF_MODEL_TYPES, in order)."""
assert tuple(HF_FAMILIES) == HF_MODEL_TYPES


def config_from_hf(config: str | dict) -> ModelConfig:
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
    # newer configs nest rope_theta and partial_rotary_factor in rope_parameters; older ones keep them top-level
    rope = c.get("rope_parameters") or {}
    # keys both families share; head_dim falls back to hidden_size / heads where a config omits it
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
        # HF Qwen3-MoE may interleave dense layers; here dense blocks can only come first
        if c.get("decoder_sparse_step", 1) != 1 or c.get("mlp_only_layers"):
            raise ValueError("qwen3_moe with decoder_sparse_step != 1 or mlp_only_layers is not supported")
        if c.get("use_sliding_window"):
            raise ValueError("qwen3_moe with use_sliding_window is not supported")
        # Qwen3-MoE always has q/k norm and the softmax router
        return ModelConfig(**common, num_experts=c.get("num_experts", c.get("num_local_experts")), qk_norm=True,
                           router="softmax")
    # glm4_moe: the sigmoid router with expert bias, shared experts, dense first blocks, partial rotary
    return ModelConfig(**common, num_experts=c["n_routed_experts"], num_shared_experts=c.get("n_shared_experts", 0),
                       first_k_dense_replace=c.get("first_k_dense_replace", 0), router="sigmoid",
                       routed_scaling_factor=c.get("routed_scaling_factor", 1.0), n_group=c.get("n_group", 1),
                       topk_group=c.get("topk_group", 1), qk_norm=c.get("use_qk_norm", False),
                       partial_rotary_factor=rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 0.5)))


def config_to_hf(cfg: ModelConfig) -> dict:
    """The HF config.json of a model (inverse of config_from_hf).

    Raises ValueError when the model has a feature its hf_model_type cannot express.
    """
    # HF requires intermediate_size even without dense blocks: the expert width stands in.
    # torch_dtype is a placeholder that save_hf overwrites with the dtype it writes.
    c = dict(model_type=cfg.hf_model_type, architectures=[HF_FAMILIES[cfg.hf_model_type]],
             vocab_size=cfg.vocab_size, hidden_size=cfg.dim, num_hidden_layers=cfg.n_layers,
             num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
             num_experts_per_tok=cfg.top_k, moe_intermediate_size=cfg.moe_inter_dim,
             intermediate_size=cfg.dense_inter_dim or cfg.moe_inter_dim, norm_topk_prob=cfg.norm_topk_prob,
             attention_bias=cfg.attention_bias, rms_norm_eps=cfg.norm_eps,
             max_position_embeddings=cfg.max_seq_len, tie_word_embeddings=cfg.tie_embeddings,
             hidden_act="silu", torch_dtype="float32",
             rope_parameters=dict(rope_type="default", rope_theta=cfg.rope_theta,
                                  partial_rotary_factor=cfg.partial_rotary_factor))
    if cfg.hf_model_type == "qwen3_moe":
        if cfg.router != "softmax" or cfg.first_k_dense_replace or cfg.num_shared_experts or not cfg.qk_norm:
            raise ValueError("qwen3_moe needs router='softmax', qk_norm, no dense layers and no shared experts")
        # every layer MoE: no interleaved dense layers
        c.update(num_experts=cfg.num_experts, decoder_sparse_step=1, mlp_only_layers=[])
    else:
        if cfg.router != "sigmoid":
            raise ValueError("glm4_moe needs router='sigmoid'")
        # num_nextn_predict_layers=0: GLM-4.5's multi-token-prediction layer is not part of this model
        c.update(n_routed_experts=cfg.num_experts, n_shared_experts=cfg.num_shared_experts,
                 first_k_dense_replace=cfg.first_k_dense_replace, routed_scaling_factor=cfg.routed_scaling_factor,
                 n_group=cfg.n_group, topk_group=cfg.topk_group, use_qk_norm=cfg.qk_norm, num_nextn_predict_layers=0)
    return c


_HF_RENAMES = [  # (our name pattern, HF names concatenated along our dim `cat`); {e} = one key per expert
    (r"embed\.weight", ["model.embed_tokens.weight"]),
    (r"norm\.weight", ["model.norm.weight"]),
    (r"lm_head\.weight", ["lm_head.weight"]),
    (r"layers\.(\d+)\.attn_norm\.weight", [r"model.layers.\1.input_layernorm.weight"]),
    (r"layers\.(\d+)\.ffn_norm\.weight", [r"model.layers.\1.post_attention_layernorm.weight"]),
    # rows q (H*d) | k (J*d) | v (J*d); \2 keeps weight or bias (GLM-4.5's q/k/v bias)
    (r"layers\.(\d+)\.attn\.wqkv\.(weight|bias)", [r"model.layers.\1.self_attn.q_proj.\2",
                                                    r"model.layers.\1.self_attn.k_proj.\2",
                                                    r"model.layers.\1.self_attn.v_proj.\2"]),
    (r"layers\.(\d+)\.attn\.wo\.weight", [r"model.layers.\1.self_attn.o_proj.weight"]),
    (r"layers\.(\d+)\.attn\.([qk])_norm\.weight", [r"model.layers.\1.self_attn.\2_norm.weight"]),  # Qwen3
    # the router, and GLM-4.5's selection bias, which HF keeps on the gate module
    (r"layers\.(\d+)\.mlp\.gate\.weight", [r"model.layers.\1.mlp.gate.weight"]),
    (r"layers\.(\d+)\.mlp\.expert_bias", [r"model.layers.\1.mlp.gate.e_score_correction_bias"]),
    # GLM-4.5's shared experts: HF's one MLP of n_shared_experts * I width, as ours
    (r"layers\.(\d+)\.mlp\.shared\.w13\.weight",
     [r"model.layers.\1.mlp.shared_experts.gate_proj.weight", r"model.layers.\1.mlp.shared_experts.up_proj.weight"]),
    (r"layers\.(\d+)\.mlp\.shared\.w2\.weight", [r"model.layers.\1.mlp.shared_experts.down_proj.weight"]),
    # stacked routed experts: w13 (E, D, 2I) <- gate|up (I, D) per expert; w2 (E, I, D) <- down (D, I)
    (r"layers\.(\d+)\.mlp\.experts\.w13",
     [r"model.layers.\1.mlp.experts.{e}.gate_proj.weight", r"model.layers.\1.mlp.experts.{e}.up_proj.weight"]),
    (r"layers\.(\d+)\.mlp\.experts\.w2", [r"model.layers.\1.mlp.experts.{e}.down_proj.weight"]),
    # the dense FFN of GLM-4.5's first blocks
    (r"layers\.(\d+)\.mlp\.w13\.weight", [r"model.layers.\1.mlp.gate_proj.weight", r"model.layers.\1.mlp.up_proj.weight"]),
    (r"layers\.(\d+)\.mlp\.w2\.weight", [r"model.layers.\1.mlp.down_proj.weight"]),
]


def hf_names(name: str) -> list[str]:
    """Our parameter name -> the HF hub names it concatenates ('{e}' = expert index of stacked experts).

    Fused weights concatenate HF's: q|k|v and gate|up along rows of a Linear weight (and
    bias), gate|up along the last dim of stacked experts [E, D, 2I], whose per-expert
    matrices are the transposes of HF's [out, in] ones.
    Raises KeyError for a name no pattern covers.
    """
    for pattern, repl in _HF_RENAMES:
        m = re.fullmatch(pattern, name)
        if m:
            return [m.expand(r) for r in repl]  # \1 the layer index, \2 what the pattern captured after it
    raise KeyError(f"no HF name for parameter {name!r}")


def hf_tensors(named_tensors, cfg: ModelConfig):
    """Our (name, tensor) pairs in the hub layout, lazily: fused q|k|v and gate|up split back into HF's
    tensors, stacked experts [E, in, out] into one [out, in] matrix per expert (the inverse of what
    load_hf reads). What save_hf writes and what SGLang's weight sync sends."""
    for name, t in named_tensors:
        keys = hf_names(name)
        if "{e}" in keys[0]:  # stacked experts [E, in, out]: each fused part transposed back to [out, in]
            for e in range(t.shape[0]):
                # w13: (D, 2I) -> gate, up (D, I) each; w2: its one part (I, D)
                for k, part in zip(keys, t[e].chunk(len(keys), dim=1)):
                    yield k.format(e=e), part.T.contiguous()  # [out, in]; contiguous: safetensors stores row-major
        else:  # fused q|k|v (unequal parts) or gate|up rows
            # q is H*d rows, k and v J*d each; gate|up are equal halves; an unfused tensor is one part
            sizes = ([cfg.n_heads * cfg.head_dim] + [cfg.n_kv_heads * cfg.head_dim] * 2 if ".wqkv." in name
                     else [t.shape[0] // len(keys)] * len(keys))
            yield from zip(keys, t.split(sizes, dim=0))  # row views of t, no copy


def load_hf(path: str, model: Transformer | None = None) -> Transformer:
    """Load an HF checkpoint folder (config.json + model.safetensors or a sharded index).

    Tensors are read lazily with `safe_open`; for a model that `parallelize` sharded, each
    rank reads only its own slice of each tensor (its experts, its rows). Without a model,
    one is built from config.json, on the CPU. Checkpoint tensors this model has no place
    for (e.g. GLM-4.5's multi-token-prediction layers) are skipped and counted.
    Raises ValueError if a tensor the model needs is missing or has another shape.
    """
    from safetensors import safe_open
    if model is None:
        # built on meta, then given uninitialised CPU storage: no random init of weights that are read next
        with torch.device("meta"):
            model = Transformer(config_from_hf(os.path.join(path, "config.json")))
        model.to_empty(device="cpu")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):  # sharded: the index names each tensor's file
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
    else:
        with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
            weight_map = {k: "model.safetensors" for k in f.keys()}
    handles = {}  # file -> open safe_open handle, each file opened once for the whole load

    def tensor(key):
        if key not in weight_map:
            raise ValueError(f"load_hf: tensor {key!r} is missing from {path}")
        file = weight_map[key]
        if file not in handles:
            handles[file] = safe_open(os.path.join(path, file), "pt")
        return handles[file].get_slice(key)  # lazy: bytes are read only when the slice is indexed

    def read_concat(keys, sl, transpose):
        """Slice `sl` of the parts concatenated along our dim 0, or, transposed, of their
        transposes along dim 1; only the rows of each part that fall in the slice are read."""
        # part `key` covers [start, start + n) of our concatenated dim; n is its HF dim 0 (rows, [out, in])
        cat_dim, out, start = (1 if transpose else 0), [], 0
        for key in keys:
            part = tensor(key)
            n = part.get_shape()[0]
            # the slice's range in the concatenated dim, intersected with this part's
            lo, hi = max(sl[cat_dim].start, start), min(sl[cat_dim].stop, start + n)
            if lo < hi:
                rows = slice(lo - start, hi - start)  # the same range in the part's own rows
                # transposed: HF rows are our columns, so take (rows, our row slice) and transpose
                out.append(part[rows, sl[0]].T if transpose else part[(rows, *sl[1:])])
            start += n
        return torch.cat(out, dim=cat_dim)

    offsets = getattr(model, "local_offsets", {})  # set by parallelize for sharded tensors
    with torch.no_grad():
        for name, t in policy_tensors(model):
            local = t.to_local() if hasattr(t, "to_local") else t  # this rank's shard of a DTensor
            start = offsets.get(name, (0,) * local.dim())  # an unsharded tensor starts at offset 0 in every dim
            sl = tuple(slice(o, o + n) for o, n in zip(start, local.shape))  # this rank's slice, per dim
            keys = hf_names(name)
            if "{e}" in keys[0]:  # stacked experts: HF stores each expert's [out, in] matrices
                # sl[0] picks this rank's experts (EP); each expert's (D, 2I) or (I, D) block is read transposed
                parts = [read_concat([k.format(e=e) for k in keys], sl[1:], transpose=True)
                         for e in range(sl[0].start, sl[0].stop)]
                src = torch.stack(parts) if parts else local.new_empty(local.shape)  # no local experts: empty
            else:
                src = read_concat(keys, sl, transpose=False)
            if tuple(src.shape) != tuple(local.shape):
                raise ValueError(f"load_hf: {keys} give shape {tuple(src.shape)}, the model wants {tuple(local.shape)}")
            local.copy_(src)  # in place: the model keeps its Parameter (and DTensor) objects
        # the softmax router's expert_bias is not persistent, so no checkpoint fills it, and to_empty left it
        # uninitialised
        for name, b in model.named_buffers():  # buffers no checkpoint holds start at zero
            if name.rsplit(".", 1)[-1] == "expert_bias" and model.cfg.router != "sigmoid":
                b.zero_()
    # every HF key the whole model reads (all experts, not only this rank's); the rest is reported unused
    known = {k.format(e=e) for n, _ in policy_tensors(model) for k in hf_names(n) for e in range(model.cfg.num_experts)}
    skipped = set(weight_map) - known
    if skipped:
        print(f"load_hf: skipped {len(skipped)} checkpoint tensors this model does not use, e.g. {sorted(skipped)[0]}")
    return model


def umask_mode(path: str):
    """Give a file the mode an ordinary open() would (0666 less the umask): safetensors writes 0600."""
    # os.umask only reads the mask by setting it: set 0, restore at once
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def save_hf(model: Transformer, path: str, *, write: bool = True, max_shard_bytes: int = 4 << 30, fp8: bool = False):
    """Write the model as an HF checkpoint: config.json plus safetensors in the hub layout (one key per
    expert), sharded with model.safetensors.index.json above max_shard_bytes.

    fp8: blockwise-FP8 instead (the DeepSeek-V3 / Qwen3-FP8 format SGLang serves with
    quantization="fp8"): the FP8 targets in e4m3 with their `weight_scale_inv`, the rest in bf16,
    and the quantization_config in config.json. Sharded (DTensor) parameters are gathered one at a
    time, so every rank must call this; only the ranks with write=True (rank 0) touch the disk.
    """
    from safetensors.torch import save_file

    # rollout.py owns the FP8 format and the size buckets, which its weight sync uses too
    from rollout import FP8, WEIGHT_BLOCK, quantize_fp8, weight_buckets
    # a generator: full_tensor (a collective) gathers one parameter at a time, in the same order on every rank
    tensors = hf_tensors(((n, full_tensor(t).cpu()) for n, t in policy_tensors(model)), model.cfg)
    if fp8:
        # the e4m3 weights and their fp32 inverse scales pass; everything else (norms, embeddings, the router
        # and its expert bias included) is written in bf16
        tensors = ((n, t if t.dtype == FP8 or n.endswith("_scale_inv") else t.to(torch.bfloat16))
                   for n, t in quantize_fp8(tensors, hf=True))
    # list(): all the gathers run here, on every rank, and each rank then holds the whole converted model on its CPU
    shards = list(weight_buckets(((n, t.contiguous()) for n, t in tensors), max_shard_bytes))
    if not write:
        return
    os.makedirs(path, exist_ok=True)
    config = config_to_hf(model.cfg)
    config["torch_dtype"] = "bfloat16" if fp8 else str(next(model.parameters()).dtype).removeprefix("torch.")
    if fp8:
        # the keys transformers and SGLang read for blockwise FP8 with activations quantised at run time
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": list(WEIGHT_BLOCK)}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    weight_map = {}
    for i, shard in enumerate(shards):
        # the hub's names: one file plain, several numbered from 1
        file = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        # format "pt": the metadata transformers' own save_pretrained writes
        save_file(dict(shard), os.path.join(path, file), metadata={"format": "pt"})
        umask_mode(os.path.join(path, file))  # 0600 -> the mode config.json got from open()
        weight_map.update({n: file for n, _ in shard})
    if len(shards) > 1:
        # total_size: bytes of all tensors, as the hub's index records it
        total = sum(t.numel() * t.element_size() for shard in shards for _, t in shard)
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
