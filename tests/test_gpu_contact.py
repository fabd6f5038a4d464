"""First contact with GPUs (issue 24), what a CPU can check: settings that cannot run on GPUs are refused
before any work. What needs a GPU is in tests/test_gpu.py (marked cuda)."""

from types import SimpleNamespace

import pytest

import sglang_engine
from config import load_config


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


def sglang_block_shapes_ok(cfg, tp: int, bf16: list[str]) -> bool:
    """SGLang's rule for a blockwise-FP8 linear under tensor parallel, written from its statement: each GPU's
    share of a split dim (a column-parallel layer's outputs, a row-parallel layer's inputs) is whole 128-blocks.
    Routed experts split by expert (tp divides their number) have no split dim."""
    def ok(width):
        return width % tp == 0 and width // tp % 128 == 0
    for i in range(cfg.n_layers):
        fp8 = lambda module: module not in bf16  # noqa: E731
        attn = f"model.layers.{i}.self_attn"
        if fp8(f"{attn}.q_proj") and not ok(cfg.n_heads * cfg.head_dim):  # q: column-parallel; o: row-parallel
            return False
        if fp8(f"{attn}.k_proj") and cfg.n_kv_heads >= tp and not ok(cfg.n_kv_heads * cfg.head_dim):
            return False
        dense = i < cfg.first_k_dense_replace
        width = cfg.dense_inter_dim if dense else cfg.num_shared_experts * cfg.moe_inter_dim
        mlp = f"model.layers.{i}.mlp" + ("" if dense else ".shared_experts")
        if width and fp8(f"{mlp}.gate_proj") and not ok(width):  # gate|up column-, down row-parallel
            return False
    return True


def test_fp8_at_tensor_parallel_keeps_bf16_the_layers_sglang_cannot_split_in_whole_blocks():
    from weights import fp8_bf16_modules
    glm = load_config("configs/100b.py", ["dry_run=True"]).model  # GLM-4.5-Air's shape
    assert not sglang_block_shapes_ok(glm, 8, [])  # the dense MLP (10944 / 8) and shared expert (1408 / 8) fail
    kept = fp8_bf16_modules(glm, 8)
    assert sglang_block_shapes_ok(glm, 8, kept)
    assert {"model.layers.0.mlp.gate_proj", "model.layers.0.mlp.down_proj",
            "model.layers.45.mlp.shared_experts.up_proj"} <= set(kept)
    assert not any("self_attn" in m or ".experts." in m for m in kept)  # attention and routed experts stay FP8
    assert fp8_bf16_modules(glm, 1) == []
    qwen = load_config("configs/qwen3_30b_a3b.py", ["dry_run=True"]).model
    assert fp8_bf16_modules(qwen, 8) == [] and sglang_block_shapes_ok(qwen, 8, [])
    with pytest.raises(ValueError, match="routed experts"):  # tp 5 splits neither the 128 experts nor 768 wide ones
        fp8_bf16_modules(qwen, 5)


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
