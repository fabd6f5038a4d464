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
    ({"torch": "2.13.0+cu130"}, "needs sglang in this environment"),  # the trainer's environment as installed
    ({"torch": "2.13.0+cu130", "sglang": "0.5.23"}, "sglang 0.5.23 needs torch==2.14.1, and this environment has "
                                                    "torch 2.13.0"),  # forced in beside it
    ({"torch": "2.14.1", "sglang": "0.5.23"}, None),  # an environment where both agree
])
def test_a_colocated_sglang_server_needs_an_sglang_that_accepts_the_trainers_torch(monkeypatch, installed, refused):
    monkeypatch.setattr(sglang_engine, "metadata", fake_metadata(installed, ["torch==2.14.1", "transformers==5.19.0"]))
    if refused is None:
        sglang_engine.check_colocated_install()
    else:
        with pytest.raises(ValueError, match=refused + ".*engine.sglang_urls"):
            sglang_engine.check_colocated_install()
