"""The GPU installs resolve: every pin of ours agrees with the pins of the wheels it installs on a Linux CUDA
machine (tools/check_install.py, against the METADATA it read from the wheels into tools/wheel_requires.json),
the SGLang server in the trainer's environment included, and both run one NCCL."""

import json
import os
import shutil
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import check_install  # noqa: E402


def requires() -> dict:
    with open(check_install.SNAPSHOT) as f:
        return json.load(f)


def test_every_install_set_resolves_the_sglang_server_in_the_trainers_environment_included():
    assert check_install.INSTALL_SETS["colocated SGLang (one environment)"] == ["requirements.txt",
                                                                                 "requirements-sglang.txt"]
    for name, files in check_install.INSTALL_SETS.items():
        assert check_install.conflicts(check_install.read_pins(files), requires()) == [], name


def test_the_check_finds_the_triton_pin_that_made_the_cuda_install_unresolvable(tmp_path):
    for file in ("requirements.txt", "requirements-sglang.txt"):
        shutil.copy(os.path.join(ROOT, file), tmp_path / file)
    text = (tmp_path / "requirements.txt").read_text()
    (tmp_path / "requirements.txt").write_text(text.replace("triton==3.7.1", "triton==3.9.0"))  # the pin before
    found = check_install.conflicts(check_install.read_pins(["requirements.txt"], str(tmp_path)), requires())
    assert found == ["torch==2.13.0 requires triton==3.7.1, and triton==3.9.0 is pinned"]


def test_the_check_follows_sglangs_own_exact_pins_into_their_requirements():
    """sglang pins transformers exactly, and transformers bounds tokenizers: our tokenizers pin before sglang 0.5.21
    breaks both, though we pin no transformers in the trainer's files; and sglang 0.5.23 wants another torch, as do
    its kernels."""
    pins = check_install.read_pins(["requirements.txt", "requirements-sglang.txt"]) | {"tokenizers": "0.23.3"}
    assert check_install.conflicts(pins, requires()) == [
        "sglang==0.5.21 requires tokenizers==0.22.2, and tokenizers==0.23.3 is pinned",
        "transformers==5.12.1 requires tokenizers<=0.23.0,>=0.22.0, and tokenizers==0.23.3 is pinned"]
    found = check_install.conflicts(check_install.read_pins(["requirements.txt"]) | {"sglang": "0.5.23"}, requires())
    assert "sglang==0.5.23 requires torch==2.14.1, and torch==2.13.0 is pinned" in found
    assert "sglang-kernel==0.4.10 requires torch==2.14.1, and torch==2.13.0 is pinned" in found


def test_the_snapshot_holds_the_cuda_wheels_own_pins():
    torch_requires = requires()["torch==2.13.0"]
    assert 'triton==3.7.1; platform_system == "Linux" and python_version < "3.15"' in torch_requires
    assert 'nvidia-nccl-cu13==2.29.7; platform_system == "Linux"' in torch_requires
    assert "torch==2.13.0" in requires()["sglang==0.5.21"] and "torch==2.13.0" in requires()["sglang-kernel==0.4.7"]


def test_the_nccl_each_sglang_release_runs_is_read_from_the_wheels_as_the_engine_holds_it():
    """sglang_server.SERVER_NCCL, which connect compares exactly against the trainer's NCCL, is what the wheels pin
    (sglang -> torch -> nvidia-nccl-cu13); the pinned server's is the pinned trainer's own."""
    from engines import sglang_server
    assert set(sglang_server.SERVER_NCCL) == set(check_install.SERVER_RELEASES)
    for release, nccl in sglang_server.SERVER_NCCL.items():
        assert check_install.server_nccl(requires(), release) == ".".join(map(str, nccl)), release
    pinned = check_install.read_pins(["requirements-sglang.txt"])["sglang"]
    trainer = check_install.trainer_nccl(requires(), f"torch=={check_install.read_pins(['requirements.txt'])['torch']}")
    assert ".".join(map(str, sglang_server.SERVER_NCCL[pinned])) == trainer == "2.29.7"
    assert check_install.nccl_pairing(requires()) == [
        "weight broadcast NCCL: sglang 0.5.21 2.29.7, trainer (torch==2.13.0) 2.29.7: the same: the weight broadcast "
        "pairs",
        "weight broadcast NCCL: sglang 0.5.23 2.30.7, trainer (torch==2.13.0) 2.29.7: differs: NCCL cannot pair them, "
        "refused at connect"]
