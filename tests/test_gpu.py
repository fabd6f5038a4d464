"""bench/gpu.py, the one-shot GPU check: ready to run on the lent GPU machine (torch 2.11, no torchtitan,
sglang, reasoning-gym or math-verify there), its code run on CPU at toy widths, and run on CUDA when one
is present. The checks read the JSON the script writes (--out), the numbers its table prints."""
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "gpu.py")
SECTIONS = ["versions", "context_and_nccl", "wide_training", "phase_rounds", "phase_rounds_other_allocator",
            "prefill_attention", "long_decode", "small_throughput", "fp8_mismatch", "continuous_paged"]  # in the order they run
HEADLINE = "lower FP8 train-inference KL with router replay"


def run_check(tmp_path, *args) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "gpu.json"  # never the committed bench/results/gpu.json
    proc = subprocess.run([sys.executable, SCRIPT, "--quick", "--out", str(out), *args], capture_output=True,
                          text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc, json.loads(out.read_text())


def test_the_gpu_check_imports_without_what_the_gpu_machine_lacks():
    absent = "; ".join(f"sys.modules[{m!r}] = None" for m in ("reasoning_gym", "torchtitan", "math_verify", "sglang"))
    code = f"import runpy, sys; {absent}; runpy.run_path({SCRIPT!r}, run_name='not_main')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]


@pytest.mark.slow
def test_the_gpu_check_runs_every_section_on_cpu_without_an_error_and_ends_with_the_headline(tmp_path):
    proc, got = run_check(tmp_path, "--device", "cpu", "--config", os.path.join(ROOT, "configs", "tiny.py"))
    assert HEADLINE in proc.stdout.splitlines()[-1]
    assert list(got["sections"]) == SECTIONS and got["done"]
    assert not [name for name, s in got["sections"].items() if "error" in s], proc.stdout
    assert not got["sections"]["prefill_attention"]["math_ran"]  # the CPU's own flash kernel, under the same check
    assert len(got["sections"]["phase_rounds_other_allocator"]["rounds"]) == 3  # the subprocess's plumbing ran
    paged = got["sections"]["continuous_paged"]
    assert paged["paged"]["same_tokens"] > 0.5 and paged["paged"]["kv_bytes"] < paged["static"]["kv_bytes"] * 1.1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_gpu_check_on_cuda_plans_memory_within_15_percent_frees_each_phase_and_never_syncs_or_runs_math(tmp_path):
    proc, got = run_check(tmp_path)
    s = got["sections"]
    assert not [name for name, x in s.items() if "error" in x or "skipped" in str(x["rows"])], proc.stdout
    # the plan against the measured peaks: the training step at GLM-4.5-Air's widths, a long decode call, the small
    # config's training step and generate call
    small = s["small_throughput"]
    for ratio in (s["wide_training"]["ratio_allocated"], s["long_decode"]["ratio"], small["train"]["ratio"],
                  small["engine"]["ratio"]):
        assert 0.85 <= ratio <= 1.15, proc.stdout
    assert 1.0 <= s["wide_training"]["ratio_used"] <= 1.3, proc.stdout  # the margins hold what the GPU used
    for phases in (s["phase_rounds"], s["phase_rounds_other_allocator"]):  # allocated back to the baseline
        assert phases["drift_bytes"] <= 16 * 2 ** 20, proc.stdout
    assert s["phase_rounds"]["expandable_segments"] != s["phase_rounds_other_allocator"]["expandable_segments"]
    assert s["prefill_attention"]["sdpa_ops"] and not s["prefill_attention"]["math_ran"], proc.stdout
    assert s["long_decode"]["decode host syncs"] == "none"
    assert small["engine"]["decode host syncs"] == "none"
