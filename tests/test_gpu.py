"""bench/gpu.py, the GPU check: ready to run on the lent GPU machine (torch 2.11, no torchtitan,
reasoning-gym or math-verify there), and run on CUDA when one is present."""
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "gpu.py")


def test_the_gpu_check_imports_without_what_the_gpu_machine_lacks():
    absent = "; ".join(f"sys.modules[{m!r}] = None" for m in ("reasoning_gym", "torchtitan", "math_verify", "sglang"))
    code = f"import runpy, sys; {absent}; runpy.run_path({SCRIPT!r}, run_name='not_main')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]


@pytest.mark.slow
def test_the_gpu_check_runs_its_code_on_cpu():
    out = subprocess.run([sys.executable, SCRIPT, "--quick", "--device", "cpu", "--config",
                          os.path.join(ROOT, "configs", "tiny.py")], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "lower FP8 train-inference KL with router replay" in out.stdout.splitlines()[-1]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_gpu_check_on_cuda_syncs_nowhere_in_a_decode_step_and_plans_memory_within_15_percent():
    out = subprocess.run([sys.executable, SCRIPT, "--quick"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = {line[:34].strip(): line[34:] for line in out.stdout.splitlines()}
    assert lines["host syncs in a decode step"].strip() == "none"
    for row in ("train peak memory", "engine generate peak memory"):
        ratio = float(lines[row].rsplit("(", 1)[1].rstrip("x)"))
        assert 0.85 <= ratio <= 1.15, out.stdout
