"""First contact with GPUs (issue 24), what a CPU can check: settings that cannot run on GPUs are refused
before any work. What needs a GPU is in tests/test_gpu.py (marked cuda)."""

import glob
import os
from types import SimpleNamespace

import pytest

import sglang_engine
from config import load_config
from weights import fp8_bf16_modules, sglang_ep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_async_rollouts_on_several_gpus_are_refused_until_nccl_from_two_threads_is_safe(monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")
    base = [f"out_dir={tmp_path}", "dry_run=True", "ep=2"]  # dry_run: this machine has no CUDA device to check
    with pytest.raises(ValueError, match="max_staleness=1: async rollouts on several GPUs are refused"):
        load_config(None, [*base, "device=cuda", "max_staleness=1"])
    assert load_config(None, [*base, "max_staleness=1"]).max_staleness == 1  # CPU ranks (gloo): async runs
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert load_config(None, [*base, "device=cuda", "max_staleness=1"]).max_staleness == 1  # one GPU: it runs


def fake_metadata(installed: dict, sglang_requires: list):
    def version(name):
        if name not in installed:
            raise sglang_engine.metadata.PackageNotFoundError(name)
        return installed[name]
    return SimpleNamespace(version=version, requires=lambda name: sglang_requires,
                           PackageNotFoundError=sglang_engine.metadata.PackageNotFoundError)


@pytest.mark.parametrize("installed, refused", [
    ({"torch": "2.13.0+cu130"}, "needs sglang in this environment"),  # the trainer's environment alone
    ({"torch": "2.13.0+cu130", "sglang": "0.5.21"}, None),  # requirements.txt + requirements-sglang.txt
    ({"torch": "2.13.0+cu130", "sglang": "0.5.23"}, "sglang 0.5.23 needs torch==2.14.1, and this environment has "
                                                    "torch 2.13.0"),  # a release that pins another torch
])
def test_a_colocated_sglang_server_needs_an_sglang_that_accepts_the_trainers_torch(monkeypatch, installed, refused):
    pins = {"0.5.21": ["torch==2.13.0", "transformers==5.12.1"], "0.5.23": ["torch==2.14.1", "transformers==5.19.0"]}
    monkeypatch.setattr(sglang_engine, "metadata", fake_metadata(installed, pins.get(installed.get("sglang"), [])))
    if refused is None:
        sglang_engine.check_colocated_install()
    else:
        with pytest.raises(ValueError, match=refused + ".*requirements-sglang.txt.*engine.sglang_urls"):
            sglang_engine.check_colocated_install()


BLOCK = 128  # the weight_block_size of every blockwise-FP8 checkpoint hf.save_hf writes


def sglang_refusal(cfg, tp: int, ep: int, fp8_kept: list[str] | None = None) -> str | None:
    """What sglang 0.5.21 refuses when it builds a server of cfg's shape on tp GPUs with expert parallel ep, or
    None. fp8_kept: None for a bf16 server, else the ignored_layers of its blockwise-FP8 checkpoint. Rewritten
    from the wheel's own code (python/sglang/srt/, line numbers of 0.5.21), apart from weights.fp8_bf16_modules,
    as SGLang builds the modules: each check is on what one GPU holds of a module."""
    # layers/linear.py (divide asserts; QKVParallelLinear 1015-1021: fewer key/value heads than GPUs are copied,
    # one a GPU, tp a multiple of their number); runtime_context.py:160 (the MoE's own tensor parallel is
    # tp // ep); layers/moe/fused_moe_triton/layer.py:397 and 407 (experts split evenly, their width too)
    kv = cfg.n_kv_heads // tp if cfg.n_kv_heads >= tp else 1
    if cfg.n_heads % tp or (cfg.n_kv_heads % tp if cfg.n_kv_heads >= tp else tp % cfg.n_kv_heads):
        return f"{cfg.n_heads} query / {cfg.n_kv_heads} key-value heads over {tp} GPUs"
    if tp % ep or cfg.num_experts % ep or cfg.moe_inter_dim % (tp // ep):
        return f"{cfg.num_experts} experts of {cfg.moe_inter_dim} at tp {tp}, ep {ep}"
    moe_tp = tp // ep
    # models/glm4_moe.py:1164-1181: on NVIDIA GLM-4.5 fuses its shared expert into the routed MoE (one more
    # expert of the same width) only without expert parallelism; 491-512 and 855-866: else it, and the dense
    # MLP, are Glm4MoeMLP over all tp GPUs
    mlps = [(f"model.layers.{i}.mlp", cfg.dense_inter_dim) for i in range(cfg.first_k_dense_replace)]
    if cfg.num_shared_experts and ep > 1:
        mlps += [(f"model.layers.{i}.mlp.shared_experts", cfg.num_shared_experts * cfg.moe_inter_dim)
                 for i in range(cfg.first_k_dense_replace, cfg.n_layers)]
    if any(width % tp for _, width in mlps):
        return "an MLP's width over the GPUs"
    if fp8_kept is None:
        return None
    # layers/quantization/fp8.py:1400-1416 (Fp8MoEMethod.create_weights): the routed experts' width on one GPU
    if cfg.moe_inter_dim // moe_tp % BLOCK:
        return (f"The output_size of gate's and up's weight = {cfg.moe_inter_dim // moe_tp} is not divisible by "
                f"weight quantization block_n = {BLOCK}.")
    kept = set(fp8_kept)

    def fused(prefix: str, parts: list[str], sizes: list[int]) -> str | None:
        # quantization/utils.py:70-103: a fused module is unquantised when all its parts are ignored, refused
        # when some are; fp8.py:582-592: a quantised one's parts on one GPU are whole block_n rows
        skipped = {f"{prefix}.{p}" in kept for p in parts}
        if len(skipped) > 1:
            return f"Detected some but not all shards of {prefix} are quantized."
        if skipped == {False} and any(size % BLOCK for size in sizes):
            return f"Weight output_partition_size = {sizes} is not divisible by weight quantization block_n = {BLOCK}."
        return None

    def row(name: str, per_gpu: int) -> str | None:  # fp8.py:574-581: a row-parallel module's inputs on one GPU
        if tp > 1 and name not in kept and per_gpu % BLOCK:
            return f"Weight input_size_per_partition = {per_gpu} is not divisible by weight quantization block_k"
        return None
    q, kv_width = cfg.n_heads * cfg.head_dim // tp, kv * cfg.head_dim
    for i in range(cfg.n_layers):
        attn = f"model.layers.{i}.self_attn"
        problem = fused(attn, ["q_proj", "k_proj", "v_proj"], [q, kv_width, kv_width]) or row(f"{attn}.o_proj", q)
        if problem:
            return problem
    for mlp, width in mlps:
        problem = fused(mlp, ["gate_proj", "up_proj"], [width // tp] * 2) or row(f"{mlp}.down_proj", width // tp)
        if problem:
            return problem
    return None


def gpu_recipes() -> dict[str, object]:
    """Every shipped recipe that runs on GPUs (configs/*.py with device='cuda'; SGLang needs CUDA) -> its config."""
    recipes = {}
    for path in sorted(glob.glob(os.path.join(ROOT, "configs", "*.py"))):
        cfg = load_config(path, ["dry_run=True"])
        if cfg.device == "cuda":
            recipes[os.path.basename(path)] = cfg
    return recipes


def test_the_wheels_rule_refuses_glm_4_5_air_in_fp8_at_tp_8_without_expert_parallelism():
    """The issue's failing launch: 1408-wide experts split 8 ways are 176 wide, no whole 128-block; with --ep-size 8
    each expert is whole on one GPU, and the shared expert and dense MLP, split 8 ways, must stay bf16."""
    glm = load_config("configs/100b.py", ["dry_run=True"]).model
    assert "weight = 176 is not divisible by weight quantization block_n = 128" in sglang_refusal(glm, 8, 1, [])
    assert "not divisible" in sglang_refusal(glm, 8, 8, [])
    assert sglang_refusal(glm, 8, 8, fp8_bf16_modules(glm, 8)) is None
    assert sglang_refusal(glm, 8, 1) is None  # served in bf16 it starts either way


def test_fp8_at_tensor_parallel_keeps_bf16_what_the_wheel_refuses_and_nothing_more():
    glm = load_config("configs/100b.py", ["dry_run=True"]).model  # GLM-4.5-Air's shape
    kept = fp8_bf16_modules(glm, 8)
    assert {"model.layers.0.mlp.gate_proj", "model.layers.0.mlp.down_proj",
            "model.layers.45.mlp.shared_experts.up_proj"} <= set(kept)
    assert not any("self_attn" in m or ".experts." in m for m in kept)  # attention and routed experts stay FP8
    for module in kept:  # each module kept bf16 is needed: FP8 there (and in the parts fused with it) is refused
        prefix, proj = module.rsplit(".", 1)
        fused = next((g for g in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")) if proj in g), (proj,))
        assert sglang_refusal(glm, 8, 8, [m for m in kept if m not in {f"{prefix}.{p}" for p in fused}]), module
    # on one GPU nothing is split, but gate|up are fused: 10944 is no whole number of 128-blocks
    assert fp8_bf16_modules(glm, 1) == ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"]
    assert sglang_refusal(glm, 1, 1, []) is not None and sglang_refusal(glm, 1, 1, fp8_bf16_modules(glm, 1)) is None
    qwen = load_config("configs/qwen3_30b_a3b.py", ["dry_run=True"]).model
    assert fp8_bf16_modules(qwen, 8) == [] and sglang_refusal(qwen, 8, 8, []) is None
    with pytest.raises(ValueError, match="routed experts"):  # tp 5 splits neither the 128 experts nor 768 wide ones
        fp8_bf16_modules(qwen, 5)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_every_gpu_recipe_launches_a_colocated_server_the_wheel_accepts(fp8):
    """Each recipe's colocated server (build_sglang_engine: tp = the node's GPUs, ep = weights.sglang_ep) starts; in
    FP8 from the checkpoint fp8_bf16_modules shapes, or fp8_bf16_modules refuses the model, as the wheel does."""
    recipes = gpu_recipes()
    assert {"100b.py", "qwen3_30b_a3b.py", "qwen3_30b_a3b_rm.py", "small.py", "smoke_gpu.py"} <= set(recipes)
    for name, cfg in recipes.items():
        tp = cfg.gpus_per_node
        ep = sglang_ep(cfg.model, tp)
        if not fp8:
            assert sglang_refusal(cfg.model, tp, ep) is None, name
            continue
        try:
            kept = fp8_bf16_modules(cfg.model, tp)
        except ValueError:  # then no choice of bf16 modules helps: the experts themselves are refused
            assert "gate's and up's weight" in sglang_refusal(cfg.model, tp, ep, []), name
            continue
        assert sglang_refusal(cfg.model, tp, ep, kept) is None, (name, sglang_refusal(cfg.model, tp, ep, kept))


DOC_SERVERS = {"/ckpt/Qwen3-30B-A3B": ("configs/qwen3_30b_a3b.py", False),
                  "/ckpt/GLM-4.5-Air-fp8": ("configs/100b.py", True)}
"""The checkpoints docs/engines.md's launch commands serve -> the recipe of their shape, and whether blockwise FP8."""


def doc_launches() -> list[dict[str, str]]:
    """The flags of each `sglang.launch_server` command in docs/engines.md (continuation lines joined)."""
    with open(os.path.join(ROOT, "docs", "engines.md")) as f:
        text = f.read().replace("\\\n", " ")
    launch = "python -m sglang.launch_server"
    commands = [line.split(launch, 1)[1] for line in text.splitlines() if launch in line]
    out = []
    for command in commands:
        words = command.split()
        out.append({w: words[i + 1] if i + 1 < len(words) and not words[i + 1].startswith("--") else ""
                    for i, w in enumerate(words) if w.startswith("--")})
    return out


def test_the_docs_launch_commands_start_servers_the_wheel_accepts_with_the_engines_expert_parallel():
    launches = doc_launches()
    assert {flags["--model-path"] for flags in launches} == set(DOC_SERVERS)
    for flags in launches:
        recipe, fp8 = DOC_SERVERS[flags["--model-path"]]
        model = load_config(recipe, ["dry_run=True"]).model
        tp, ep = int(flags["--tp"]), int(flags.get("--ep-size", 1))
        assert ep == sglang_ep(model, tp), flags  # what fp8_bf16_modules and the colocated launch assume
        assert sglang_refusal(model, tp, ep, fp8_bf16_modules(model, tp) if fp8 else None) is None, flags
        assert "--enable-return-routed-experts" in flags and "--enable-deterministic-inference" in flags
        assert flags.get("--dtype") == "bfloat16"  # what sglang_engine sends fp32 weights as (_as_served)


def test_an_fp8_checkpoint_lists_the_layers_it_keeps_bf16_as_sglang_reads_them(tmp_path, tiny_cfg):
    import json

    from safetensors import safe_open

    from hf import save_hf
    from model import Transformer
    from weights import FP8
    kept = ["model.layers.0.self_attn.q_proj"]
    save_hf(Transformer(tiny_cfg), str(tmp_path), fp8=True, bf16_modules=kept)
    config = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert config["ignored_layers"] == kept and config["quant_method"] == "fp8"
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight").dtype != FP8
        assert "model.layers.0.self_attn.q_proj.weight_scale_inv" not in f.keys()
        assert f.get_tensor("model.layers.0.self_attn.k_proj.weight").dtype == FP8
