"""The GPU installs resolve: every pin of ours agrees with the pins of the wheels it installs on a Linux CUDA
machine (tools/check_install.py, against the METADATA it read from the wheels into tools/wheel_requires.json)."""

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


def test_each_install_set_resolves_and_sglang_cannot_share_the_trainers_environment():
    for name, files in check_install.INSTALL_SETS.items():
        found = check_install.conflicts(check_install.read_pins(files), requires())
        if name in check_install.EXPECTED_TO_CONFLICT:
            assert any("requires torch==2.14.1" in c for c in found), found  # hence SGLang in its own environment
        else:
            assert not found, (name, found)


def test_the_check_finds_the_triton_pin_that_made_the_cuda_install_unresolvable(tmp_path):
    for file in ("requirements.txt", "requirements-sglang.txt"):
        shutil.copy(os.path.join(ROOT, file), tmp_path / file)
    text = (tmp_path / "requirements.txt").read_text()
    (tmp_path / "requirements.txt").write_text(text.replace("triton==3.7.1", "triton==3.9.0"))  # the pin before
    found = check_install.conflicts(check_install.read_pins(["requirements.txt"], str(tmp_path)), requires())
    assert found == ["torch==2.13.0 requires triton==3.7.1, and triton==3.9.0 is pinned"]


def test_the_snapshot_holds_the_cuda_wheels_own_pins():
    torch_requires = requires()["torch==2.13.0"]
    assert 'triton==3.7.1; platform_system == "Linux" and python_version < "3.15"' in torch_requires
    assert 'nvidia-nccl-cu13==2.29.7; platform_system == "Linux"' in torch_requires


def test_the_weight_broadcasts_nccl_pairing_is_read_from_the_wheels_as_the_engine_holds_it():
    """The trainer's torch and SGLang's own torch pin different NCCLs; sglang_engine warns of it at connect from
    its SERVER_NCCL and TRAINER_NCCL, which must be what the wheels say."""
    import sglang_server
    line = check_install.nccl_pairing(requires())
    server = sglang_server.SERVER_NCCL[check_install.read_pins(["requirements-sglang.txt"])["sglang"]]
    assert f"nvidia-nccl-cu13=={'.'.join(map(str, server))} (torch==2.14.1)" in line
    assert f"nvidia-nccl-cu13=={'.'.join(map(str, sglang_server.TRAINER_NCCL))} (torch==2.13.0)" in line
    assert "different versions in one communicator" in line
