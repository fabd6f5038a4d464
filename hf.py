"""HF checkpoints: model.Transformer in and out of the hub's safetensors layout.

`load_hf(path)` reads config.json (`config_from_hf`) and the safetensors files, one or
sharded with model.safetensors.index.json, lazily with `safe_open`, and a parallelized model
reads only its local shard (at the offsets its caller passes: distributed.shard_offsets), never the full tensor.
`save_hf(model, path)` writes the reverse (HF names, split and transposed back) plus
config.json, loadable by transformers and SGLang; `hf_tensors` is the same conversion as a
stream, which SGLang's weight sync also sends. The name map `_HF_RENAMES` covers Qwen3-MoE
(arXiv 2505.09388) and GLM-4.5 (arXiv 2508.06471); the FP8 variant is DeepSeek-V3's
blockwise format (arXiv 2412.19437).
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
   layers) are skipped, counted and named in one line. A tied lm_head is the embedding (HF's
   tied checkpoints have no lm_head.weight); a config.json that ties them over files holding a
   distinct lm_head loads untied, as transformers loads it (hf_config.read_config).
5. config.json: each key is implemented with transformers 5.24's meaning and default
   (`HF_DEFAULTS`), harmless (`HF_HARMLESS`) or implemented at one value (`HF_ONLY`); anything
   else is refused, so a checkpoint runs as transformers runs it or not at all.
6. Nothing is loaded unproven: every tensor the model reads is there, in the file the index
   names, with the shape config.json gives it (`hf_shapes`), before any is read (headers only:
   `check_weights`, which train.prepare runs before any work, and load_hf on every rank); each
   piece read is finite. Each failure is a ValueError naming the tensor and its file.
"""

from __future__ import annotations

import json
import os
import re
from typing import Sequence

import torch
from safetensors import SafetensorError

from hf_config import EMBED, INDEX, LM_HEAD, config_to_hf, read_config, shape_differences, weight_files
from model import ModelConfig, Transformer
from weights import FP8, WEIGHT_BLOCK, full_tensor, local, policy_tensors, quantize_fp8, weight_buckets


# re.fullmatch against our whole name: no pattern matches a name another one does, so the order is free
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
    (r"layers\.(\d+)\.attn\.wo\.(weight|bias)", [r"model.layers.\1.self_attn.o_proj.\2"]),  # bias: Qwen3-MoE's
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


def from_hf(name: str, sl: tuple[slice, ...], read, rows, *, tied: bool = False) -> torch.Tensor:
    """Slice `sl` of our tensor `name`, assembled from HF's tensors: the inverse of hf_tensors, as load_hf reads a
    checkpoint (each rank its own slice) and a stand-in SGLang server takes a weight sync (the whole tensor).
    read(key, index): part `index` of HF tensor key; rows(key): its rows (dim 0, HF's [out, in]). tied: a tied
    lm_head reads the embedding. Only the rows of each part that fall in the slice are read."""
    keys = hf_names("embed.weight" if name == "lm_head.weight" and tied else name)

    def concat(keys, sl, transpose):
        """Slice sl of the parts concatenated along our dim 0, or, transposed, of their transposes along dim 1."""
        # part `key` covers [start, start + n) of our concatenated dim; n is its HF dim 0 (rows, [out, in])
        cat_dim, out, start = (1 if transpose else 0), [], 0
        for key in keys:
            n = rows(key)
            # the slice's range in the concatenated dim, intersected with this part's
            lo, hi = max(sl[cat_dim].start, start), min(sl[cat_dim].stop, start + n)
            if lo < hi:
                part = slice(lo - start, hi - start)  # the same range in the part's own rows
                # transposed: HF rows are our columns, so take (rows, our row slice) and transpose
                out.append(read(key, (part, sl[0])).T if transpose else read(key, (part, *sl[1:])))
            start += n
        return torch.cat(out, dim=cat_dim)

    if "{e}" in keys[0]:  # stacked experts: HF stores each expert's [out, in] matrices
        # sl[0] picks the experts (a rank's under EP); each expert's (D, 2I) or (I, D) block is read transposed
        return torch.stack([concat([k.format(e=e) for k in keys], sl[1:], transpose=True)
                            for e in range(sl[0].start, sl[0].stop)])
    return concat(keys, sl, transpose=False)


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor a model of cfg reads (each expert's; lm_head.weight only untied) -> the shape config.json
    gives it: save_hf's conversion (`hf_tensors`) run over the model's tensors on meta, which hold no storage."""
    with torch.device("meta"):
        model = Transformer(cfg)
    return {k: tuple(t.shape) for k, t in hf_tensors(policy_tensors(model), cfg)}


Source = tuple[str, str, tuple[int, ...]]  # where an HF tensor is read: (file, its name in that file, shape)


def _proven_sources(path: str, cfg: ModelConfig) -> tuple[dict[str, Source], dict[str, str]]:
    """HF name -> (file, name in that file, shape) of every tensor a model of cfg reads from checkpoint folder
    `path`, each checked there with the shape config.json gives it (`hf_shapes`) from the headers alone; and
    weight_files(path). A tied model whose files hold only lm_head.weight reads its embedding from it, as
    transformers ties the embedding to what is there. Raises ValueError (weight_files', or naming the tensor, its
    file and both shapes)."""
    from safetensors import safe_open
    files = weight_files(path)
    listing = INDEX if os.path.isfile(os.path.join(path, INDEX)) else "model.safetensors"
    alias = {EMBED: LM_HEAD} if cfg.tie_embeddings and EMBED not in files and LM_HEAD in files else {}
    sources, by_file = {}, {}  # by_file: file -> its (name, shape) pairs, so each header is opened once
    for key, shape in hf_shapes(cfg).items():
        stored = alias.get(key, key)
        if stored not in files:
            raise ValueError(f"{key} is missing: {listing} does not {'name' if listing == INDEX else 'hold'} it")
        sources[key] = (files[stored], stored, shape)
        by_file.setdefault(files[stored], []).append((stored, shape))
    for file, wanted in sorted(by_file.items()):
        with safe_open(os.path.join(path, file), "pt") as header:
            for stored, shape in wanted:
                found = tuple(header.get_slice(stored).get_shape())
                if found != shape:
                    raise ValueError(f"{stored} in {file} has shape {found}; config.json gives it {shape}")
    return sources, files


def _model_for(path: str, model: Transformer | None) -> tuple[Transformer, ModelConfig]:
    """The model load_hf fills: `model` checked against path's config.json, or one built from it on
    the CPU, uninitialised; and that config. Raises ValueError as load_hf documents."""
    try:
        want = read_config(path)
    except ValueError as e:
        raise ValueError(f"load_hf: {path}: {e}") from None
    if model is None:
        # built on meta, then given uninitialised CPU storage: no random init of weights that are read next
        with torch.device("meta"):
            model = Transformer(want)
        model.to_empty(device="cpu")
        if want.tie_embeddings:  # to_empty gave lm_head a tensor of its own: one Parameter again
            model.lm_head.weight = model.embed.weight
    if differ := shape_differences(model.cfg, want):
        raise ValueError(f"load_hf: the model's config and {path}/config.json differ in (model's, file's) {differ}")
    return model, want


def check_weights(name: str, path: str):
    """Checkpoint folder `path`'s safetensors files exist (each one its index names) and their headers read, and
    every tensor its config.json's model reads is there with the shape config.json gives it (`_proven_sources`):
    a cheap look, headers only, before any work. Values (NaN, inf) only load_hf sees. Raises ValueError starting
    with `name` (the field) and naming the file (and the tensor)."""
    try:
        _proven_sources(path, read_config(path))
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


def load_hf(path: str, model: Transformer | None = None, *,
            offsets: dict[str, tuple[int, ...]] | None = None) -> Transformer:
    """Load an HF checkpoint folder (config.json + model.safetensors or a sharded index).

    Tensors are read lazily with `safe_open`; for a model that `parallelize` sharded, each
    rank reads only its own slice of each tensor (its experts, its rows), which starts at
    offsets[name] (distributed.shard_offsets(model): each sharded tensor's global offset of
    this rank's slice, per dim; an unsharded tensor starts at 0). Without a model,
    one is built from config.json, on the CPU. Checkpoint tensors this model has no place
    for (e.g. GLM-4.5's multi-token-prediction layers) are skipped and counted. A tied
    lm_head reads the embedding (HF's checkpoints of tied models have no lm_head.weight).
    Raises ValueError (config_from_hf's) on a config.json this model does not implement, if a
    given model's config differs from it (max_seq_len aside), if the weights are quantised, if
    a tensor the model needs is missing or has another shape (every rank checks every header
    first, check_weights' check), if a piece a rank reads holds a NaN or inf, or if a sharded
    tensor has no offset in `offsets`.
    """
    from safetensors import safe_open
    model, want = _model_for(path, model)
    try:
        sources, files = _proven_sources(path, want)
    except ValueError as e:
        raise ValueError(f"load_hf: {path}: {e}") from None
    handles = {}  # file -> open safe_open handle, each file opened once for the whole load

    def read(key, index):
        """Part `index` of HF tensor `key`, proven finite: the bytes read are only the part's."""
        file, stored, _ = sources[key]
        if file not in handles:
            handles[file] = safe_open(os.path.join(path, file), "pt")
        x = handles[file].get_slice(stored)[index]
        if not torch.isfinite(x).all():
            raise ValueError(f"load_hf: {path}: {stored} in {file} holds NaN or inf ({(~torch.isfinite(x)).sum()} "
                             f"of the {x.numel()} values read)")
        return x

    offsets = offsets or {}
    with torch.no_grad():
        for name, t in policy_tensors(model):
            shard = local(t)  # this rank's shard of a DTensor; the tensor itself otherwise
            if shard.numel() == 0:  # an uneven shard leaves this rank none of the tensor: nothing to read
                continue
            if name not in offsets and shard.shape != t.shape:  # else every rank would read the first slice
                raise ValueError(f"load_hf: {path}: {name} is sharded ({tuple(shard.shape)} of {tuple(t.shape)} here) "
                                 f"and offsets has no place for it: pass offsets=distributed.shard_offsets(model)")
            start = offsets.get(name, (0,) * shard.dim())  # an unsharded tensor starts at offset 0 in every dim
            sl = tuple(slice(o, o + n) for o, n in zip(start, shard.shape))  # this rank's slice, per dim
            # a tied lm_head that to_empty untied (a parallelized model's) reads the embedding, as HF ties them
            src = from_hf(name, sl, read, lambda key: sources[key][2][0], tied=model.cfg.tie_embeddings)
            # every part's shape is proven and the model's config is the file's: a slice of another shape is a bug here
            assert tuple(src.shape) == tuple(shard.shape), (name, tuple(src.shape), tuple(shard.shape))
            shard.copy_(src)  # in place: the model keeps its Parameter (and DTensor) objects
        # the softmax router's expert_bias is not persistent, so no checkpoint fills it, and to_empty left it
        # uninitialised
        for name, b in model.named_buffers():  # buffers no checkpoint holds start at zero
            if name.rsplit(".", 1)[-1] == "expert_bias" and model.cfg.router != "sigmoid":
                b.zero_()
    # every HF key the whole model reads (all experts, not only this rank's; a tied model's lm_head, which tied
    # only because it equals the embedding); the rest is reported unused
    skipped = set(files) - {stored for _, stored, _ in sources.values()} - ({LM_HEAD} if want.tie_embeddings else set())
    if skipped:
        print(f"load_hf: skipped {len(skipped)} checkpoint tensors this model does not use, e.g. {sorted(skipped)[0]}")
    return model


def umask_mode(path: str):
    """Give a file the mode an ordinary open() would (0666 less the umask): safetensors writes 0600."""
    # os.umask only reads the mask by setting it: set 0, restore at once
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def save_hf(model: Transformer, path: str, *, write: bool = True, max_shard_bytes: int = 4 << 30, fp8: bool = False,
            bf16_modules: Sequence[str] = ()):
    """Write the model as an HF checkpoint: safetensors in the hub layout (one key per expert), sharded
    above max_shard_bytes (model-0000i-of-0000n.safetensors with model.safetensors.index.json, else one
    model.safetensors), then config.json.

    fp8: blockwise-FP8 instead (the DeepSeek-V3 / Qwen3-FP8 format SGLang serves with
    quantization="fp8"): the FP8 targets in e4m3 with their `weight_scale_inv`, the rest in bf16,
    and the quantization_config in config.json; bf16_modules (weights.fp8_bf16_modules) stay bf16,
    its ignored_layers. Parameters are gathered one at a time (`full_tensor`,
    a collective), so every rank must call this; only the rank with write=True (rank 0) keeps them,
    and it writes each shard as soon as it fills and frees it: its peak is one shard and one
    parameter, never the whole model. Raises ValueError (config_to_hf's) on a model its
    hf_model_type cannot express.
    A write that fails (OSError, SafetensorError: a full disk, no permission) is raised once this rank has taken
    part in every remaining gather, with no provisional `.partial` shard left, so a caller can retry elsewhere.
    """
    config = config_to_hf(model.cfg)  # first: a model the family cannot express fails before any gather
    # a generator: full_tensor gathers one parameter at a time, in policy_tensors' order on every rank
    gathered = ((n, full_tensor(t)) for n, t in policy_tensors(model))
    if not write:
        for _ in gathered:  # this rank takes part in every gather and keeps nothing
            pass
        return
    tensors = hf_tensors(((n, t.cpu()) for n, t in gathered), model.cfg)
    if fp8:
        # the e4m3 weights and their fp32 inverse scales pass; everything else (norms, embeddings, the router
        # and its expert bias included) is written in bf16
        tensors = ((n, t if t.dtype == FP8 or n.endswith("_scale_inv") else t.to(torch.bfloat16))
                   for n, t in quantize_fp8(tensors, hf=True, bf16=bf16_modules))
    config["torch_dtype"] = "bfloat16" if fp8 else str(next(model.parameters()).dtype).removeprefix("torch.")
    if fp8:
        # the keys transformers and SGLang read for blockwise FP8 with activations quantised at run time
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": list(WEIGHT_BLOCK), "ignored_layers": list(bf16_modules)}
    files = []  # the provisional shards written so far
    try:
        _write_hf(path, tensors, config, files, max_shard_bytes)
    except (OSError, SafetensorError):  # a full disk, a folder made read-only: the machine's answer, not a bug
        for _ in gathered:  # the other ranks wait in the gathers of the parameters not yet written: take part
            pass
        for f in files:  # no provisional shard left behind (their room is what a retry elsewhere may need)
            try:
                os.remove(os.path.join(path, f))
            except OSError:
                pass  # renamed already, or never made
        raise


def _write_hf(path: str, tensors, config: dict, files: list[str], max_shard_bytes: int):
    # save_hf's writes (rank 0's): the shards, then config.json; `files` collects each provisional shard as written
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    weight_map, total = {}, 0
    for shard in weight_buckets(((n, t.contiguous()) for n, t in tensors), max_shard_bytes):
        # the hub numbers shards "-of-" their count, known only at the end: a provisional name until then.
        # format "pt": the metadata transformers' own save_pretrained writes
        file = f"model-{len(files) + 1:05d}.safetensors.partial"
        files.append(file)  # before the write: one cut short is removed too
        save_file(dict(shard), os.path.join(path, file), metadata={"format": "pt"})
        weight_map.update({n: file for n, _ in shard})
        total += sum(t.numel() * t.element_size() for _, t in shard)  # the index's total_size: bytes of all tensors
        del shard  # freed before weight_buckets gathers the next shard's parameters
    # the hub's names: one file plain, several numbered from 1
    final = {f: "model.safetensors" if len(files) == 1 else f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
             for i, f in enumerate(files)}
    for f, name in final.items():
        os.replace(os.path.join(path, f), os.path.join(path, name))
        umask_mode(os.path.join(path, name))  # 0600 -> the mode config.json gets from open()
    # an earlier save's shards and index would send load_hf (or transformers) to old weights
    for f in os.listdir(path):
        if re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", f) and f not in final.values():
            os.remove(os.path.join(path, f))
    index = os.path.join(path, "model.safetensors.index.json")
    if len(files) > 1:
        with open(index, "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": {n: final[v] for n, v in weight_map.items()}},
                      f, indent=1)
    elif os.path.exists(index):
        os.remove(index)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
