import glob
import os

import pytest
import torch

import train
from hf import config_to_hf
from plan import param_counts, print_plan

CONFIGS = sorted(glob.glob(os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs", "*.py")))


@pytest.mark.parametrize("path", CONFIGS, ids=[os.path.basename(p) for p in CONFIGS])
def test_every_config_passes_the_dry_run_plan(path, capsys):
    result = train.main(train.parse_args([path, "dry_run=True"]))
    assert len(result["plan"]) >= 1 and all(row["total"] > 0 for row in result["plan"])
    assert "parameters:" in capsys.readouterr().out


def test_100b_param_count_equals_transformers_on_meta():
    transformers = pytest.importorskip("transformers", reason="transformers is a test-only dependency")
    cfg = train.parse_args([os.path.join(os.path.dirname(CONFIGS[0]), "100b.py")]).model
    with torch.device("meta"):
        ref = transformers.AutoModelForCausalLM.from_config(transformers.Glm4MoeConfig(**config_to_hf(cfg)))
    counts = param_counts(cfg)
    assert counts["total"] == sum(p.numel() for p in ref.parameters())
    assert 105e9 < counts["total"] < 108e9 and 11.5e9 < counts["active"] - counts["embed_lm_head"] < 12.5e9  # "106B / 12B active"


def test_qwen3_30b_a3b_param_count_equals_transformers_on_meta():
    transformers = pytest.importorskip("transformers", reason="transformers is a test-only dependency")
    cfg = train.parse_args([os.path.join(os.path.dirname(CONFIGS[0]), "qwen3_30b_a3b.py")]).model
    with torch.device("meta"):
        ref = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3MoeConfig(**config_to_hf(cfg)))
    assert param_counts(cfg)["total"] == sum(p.numel() for p in ref.parameters())


class ChecksPassed(Exception):
    """Raised where main() starts building the task: every setting was accepted up to there."""


@pytest.mark.parametrize("path", CONFIGS, ids=[os.path.basename(p) for p in CONFIGS])
def test_every_config_passes_the_checks_a_real_run_makes_before_training(path, tmp_path, monkeypatch):
    def stop(*args, **kwargs):
        raise ChecksPassed

    monkeypatch.setattr(train, "TaskMix", stop)
    cpu = [] if torch.cuda.is_available() else ["device=cpu"]  # a CUDA config's checks, on this machine's device
    with pytest.raises(ChecksPassed):
        train.main(train.parse_args([path, f"out_dir={tmp_path}", *cpu]))


def test_small_config_fits_one_80gb_gpu():
    cfg = train.parse_args([os.path.join(os.path.dirname(CONFIGS[0]), "small.py")])
    rows = print_plan(cfg.model, gpus_per_node=cfg.gpus_per_node, ep=cfg.ep, microbatch_tokens=cfg.microbatch_tokens,
                      activation_checkpoint=cfg.activation_checkpoint, nodes=(1,))
    assert rows[0]["gpus"] == 1 and "H100 80GB" in rows[0]["fits"]
    assert 2e8 < param_counts(cfg.model)["total"] < 1e9  # "a few hundred M"
