"""HF checkpoints: model.Transformer in and out of the hub's safetensors layout.

`load_hf(path)` reads config.json (ModelConfig.from_hf) and the safetensors files, one or
sharded with model.safetensors.index.json, lazily with `safe_open`: each of our tensors is
read from its HF tensors (q/k/v and gate/up concatenated into our fused wqkv and w13, the
per-expert matrices stacked), and a parallelized model reads only its local shard
(`Transformer.local_offsets`), never the full tensor. `save_hf(model, path)` writes the
reverse (HF names, split and transposed back) plus config.json, loadable by transformers
and SGLang. Raises ValueError on a missing tensor or a shape that does not match.
"""

from __future__ import annotations

import json
import os
import re

import torch

from model import ModelConfig, Transformer, full_tensor, policy_tensors


_HF_RENAMES = [  # (our name pattern, HF names concatenated along our dim `cat`); {e} = one key per expert
    (r"embed\.weight", ["model.embed_tokens.weight"]),
    (r"norm\.weight", ["model.norm.weight"]),
    (r"lm_head\.weight", ["lm_head.weight"]),
    (r"layers\.(\d+)\.attn_norm\.weight", [r"model.layers.\1.input_layernorm.weight"]),
    (r"layers\.(\d+)\.ffn_norm\.weight", [r"model.layers.\1.post_attention_layernorm.weight"]),
    (r"layers\.(\d+)\.attn\.wqkv\.(weight|bias)", [r"model.layers.\1.self_attn.q_proj.\2",
                                                    r"model.layers.\1.self_attn.k_proj.\2",
                                                    r"model.layers.\1.self_attn.v_proj.\2"]),
    (r"layers\.(\d+)\.attn\.wo\.weight", [r"model.layers.\1.self_attn.o_proj.weight"]),
    (r"layers\.(\d+)\.attn\.([qk])_norm\.weight", [r"model.layers.\1.self_attn.\2_norm.weight"]),
    (r"layers\.(\d+)\.mlp\.gate\.weight", [r"model.layers.\1.mlp.gate.weight"]),
    (r"layers\.(\d+)\.mlp\.expert_bias", [r"model.layers.\1.mlp.gate.e_score_correction_bias"]),
    (r"layers\.(\d+)\.mlp\.shared\.w13\.weight",
     [r"model.layers.\1.mlp.shared_experts.gate_proj.weight", r"model.layers.\1.mlp.shared_experts.up_proj.weight"]),
    (r"layers\.(\d+)\.mlp\.shared\.w2\.weight", [r"model.layers.\1.mlp.shared_experts.down_proj.weight"]),
    (r"layers\.(\d+)\.mlp\.experts\.w13",
     [r"model.layers.\1.mlp.experts.{e}.gate_proj.weight", r"model.layers.\1.mlp.experts.{e}.up_proj.weight"]),
    (r"layers\.(\d+)\.mlp\.experts\.w2", [r"model.layers.\1.mlp.experts.{e}.down_proj.weight"]),
    (r"layers\.(\d+)\.mlp\.w13\.weight", [r"model.layers.\1.mlp.gate_proj.weight", r"model.layers.\1.mlp.up_proj.weight"]),
    (r"layers\.(\d+)\.mlp\.w2\.weight", [r"model.layers.\1.mlp.down_proj.weight"]),
]


def hf_names(name: str) -> list[str]:
    """Our parameter name -> the HF hub names it concatenates ('{e}' = expert index of stacked experts).

    Fused weights concatenate HF's: q|k|v and gate|up along rows of a Linear weight (and
    bias), gate|up along the last dim of stacked experts [E, D, 2I], whose per-expert
    matrices are the transposes of HF's [out, in] ones.
    """
    for pattern, repl in _HF_RENAMES:
        m = re.fullmatch(pattern, name)
        if m:
            return [m.expand(r) for r in repl]
    raise KeyError(f"no HF name for parameter {name!r}")


def hf_tensors(named_tensors, cfg: ModelConfig):
    """Our (name, tensor) pairs in the hub layout, lazily: fused q|k|v and gate|up split back into HF's
    tensors, stacked experts [E, in, out] into one [out, in] matrix per expert (the inverse of what
    load_hf reads). What save_hf writes and what SGLang's weight sync sends."""
    for name, t in named_tensors:
        keys = hf_names(name)
        if "{e}" in keys[0]:  # stacked experts [E, in, out]: each fused part transposed back to [out, in]
            for e in range(t.shape[0]):
                for k, part in zip(keys, t[e].chunk(len(keys), dim=1)):
                    yield k.format(e=e), part.T.contiguous()
        else:  # fused q|k|v (unequal parts) or gate|up rows
            sizes = ([cfg.n_heads * cfg.head_dim] + [cfg.n_kv_heads * cfg.head_dim] * 2 if ".wqkv." in name
                     else [t.shape[0] // len(keys)] * len(keys))
            yield from zip(keys, t.split(sizes, dim=0))


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
        with torch.device("meta"):
            model = Transformer(ModelConfig.from_hf(os.path.join(path, "config.json")))
        model.to_empty(device="cpu")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
    else:
        with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
            weight_map = {k: "model.safetensors" for k in f.keys()}
    handles = {}

    def tensor(key):
        if key not in weight_map:
            raise ValueError(f"load_hf: tensor {key!r} is missing from {path}")
        file = weight_map[key]
        if file not in handles:
            handles[file] = safe_open(os.path.join(path, file), "pt")
        return handles[file].get_slice(key)

    def read_concat(keys, sl, transpose):
        """Slice `sl` of the parts concatenated along our dim 0, or, transposed, of their
        transposes along dim 1; only the rows of each part that fall in the slice are read."""
        cat_dim, out, start = (1 if transpose else 0), [], 0
        for key in keys:
            part = tensor(key)
            n = part.get_shape()[0]
            lo, hi = max(sl[cat_dim].start, start), min(sl[cat_dim].stop, start + n)
            if lo < hi:
                rows = slice(lo - start, hi - start)
                out.append(part[rows, sl[0]].T if transpose else part[(rows, *sl[1:])])
            start += n
        return torch.cat(out, dim=cat_dim)

    offsets = getattr(model, "local_offsets", {})  # set by parallelize for sharded tensors
    with torch.no_grad():
        for name, t in policy_tensors(model):
            local = t.to_local() if hasattr(t, "to_local") else t
            start = offsets.get(name, (0,) * local.dim())
            sl = tuple(slice(o, o + n) for o, n in zip(start, local.shape))
            keys = hf_names(name)
            if "{e}" in keys[0]:  # stacked experts: HF stores each expert's [out, in] matrices
                parts = [read_concat([k.format(e=e) for k in keys], sl[1:], transpose=True)
                         for e in range(sl[0].start, sl[0].stop)]
                src = torch.stack(parts) if parts else local.new_empty(local.shape)
            else:
                src = read_concat(keys, sl, transpose=False)
            if tuple(src.shape) != tuple(local.shape):
                raise ValueError(f"load_hf: {keys} give shape {tuple(src.shape)}, the model wants {tuple(local.shape)}")
            local.copy_(src)
        for name, b in model.named_buffers():  # buffers no checkpoint holds start at zero
            if name.rsplit(".", 1)[-1] == "expert_bias" and model.cfg.router != "sigmoid":
                b.zero_()
    known = {k.format(e=e) for n, _ in policy_tensors(model) for k in hf_names(n) for e in range(model.cfg.num_experts)}
    skipped = set(weight_map) - known
    if skipped:
        print(f"load_hf: skipped {len(skipped)} checkpoint tensors this model does not use, e.g. {sorted(skipped)[0]}")
    return model


def umask_mode(path: str):
    """Give a file the mode an ordinary open() would (0666 less the umask): safetensors writes 0600."""
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

    from rollout import FP8, WEIGHT_BLOCK, quantize_fp8, weight_buckets
    tensors = hf_tensors(((n, full_tensor(t).cpu()) for n, t in policy_tensors(model)), model.cfg)
    if fp8:
        tensors = ((n, t if t.dtype == FP8 or n.endswith("_scale_inv") else t.to(torch.bfloat16))
                   for n, t in quantize_fp8(tensors, hf=True))
    shards = list(weight_buckets(((n, t.contiguous()) for n, t in tensors), max_shard_bytes))
    if not write:
        return
    os.makedirs(path, exist_ok=True)
    config = model.cfg.to_hf()
    config["torch_dtype"] = "bfloat16" if fp8 else str(next(model.parameters()).dtype).removeprefix("torch.")
    if fp8:
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": list(WEIGHT_BLOCK)}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    weight_map = {}
    for i, shard in enumerate(shards):
        file = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(dict(shard), os.path.join(path, file), metadata={"format": "pt"})
        umask_mode(os.path.join(path, file))
        weight_map.update({n: file for n, _ in shard})
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for shard in shards for _, t in shard)
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
