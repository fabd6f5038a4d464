"""bench/gpu.py, the one-shot GPU check: ready to run on the lent GPU machine (torch 2.11, no torchtitan,
sglang, reasoning-gym or math-verify there), its code run on CPU at toy widths (--smoke, with those packages
hidden), its plans (bench/gpu_plans.json) what the code computes now, its cut of GLM-4.5-Air the one that fits
the GPU, and run on CUDA when one is present. The checks read the JSON the script writes (--out), the numbers
its table prints."""
import importlib.util
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
ABSENT = ("torchtitan", "sglang", "reasoning_gym", "math_verify")  # what the lent GPU machine lacks
# a sitecustomize that makes importing them fail, in the script and in the subprocess it starts (section 4)
HIDE = f"""import sys
class Hide:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {ABSENT!r}:
            raise ImportError(f"{{name}} is not installed on the lent GPU machine")
sys.meta_path.insert(0, Hide())
"""


def gpu_module():
    """bench/gpu.py imported (it puts the repo and bench/ on sys.path, as run)."""
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = sys.modules["gpu_check"] = importlib.util.module_from_spec(spec)  # its dataclasses look it up there
    spec.loader.exec_module(module)
    return module


def hidden_env(tmp_path) -> dict:
    (tmp_path / "hide").mkdir()
    (tmp_path / "hide" / "sitecustomize.py").write_text(HIDE)
    return {**os.environ, "PYTHONPATH": str(tmp_path / "hide")}


def run_check(tmp_path, *args, env=None) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "gpu.json"  # never the committed bench/results/gpu.json
    proc = subprocess.run([sys.executable, SCRIPT, "--out", str(out), *args], capture_output=True, text=True, cwd=ROOT,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc, json.loads(out.read_text())


def test_the_gpu_check_smoke_runs_every_section_on_cpu_without_torchtitan_or_sglang(tmp_path):  # about 50 s
    env = hidden_env(tmp_path)
    for name in ABSENT:  # the hiding works (and reaches any python the script starts)
        tried = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True, text=True, env=env)
        assert "is not installed on the lent GPU machine" in tried.stderr, tried.stderr[-500:]
    proc, got = run_check(tmp_path, "--smoke", env=env)
    assert HEADLINE in proc.stdout.splitlines()[-1]
    assert list(got["sections"]) == SECTIONS and got["done"] and got["smoke"]
    assert not [name for name, s in got["sections"].items() if "error" in s], proc.stdout
    assert len(got["sections"]["phase_rounds_other_allocator"]["rounds"]) == 3  # the subprocess ran, hidden too
    # the plans were read: the first line names the cut each GPU would run
    assert "H100 80GB: 48; H200 141GB: 128" in proc.stdout.splitlines()[0], proc.stdout.splitlines()[0]


def test_the_gpu_plans_were_computed_from_todays_configs_and_plan_code():
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import gpu_plans
    assert gpu_plans.read_plans()["inputs"] == gpu_plans.inputs(), \
        "bench/gpu_plans.json is stale: run python bench/gpu.py --write_plans"


@pytest.mark.slow
def test_the_gpu_plans_are_what_the_code_computes_now():  # about 15 s: the plans' fake training steps
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import gpu_plans
    assert gpu_plans.read_plans() == json.loads(json.dumps(gpu_plans.compute_plans())), \
        "bench/gpu_plans.json is stale: run python bench/gpu.py --write_plans"


def test_the_cut_is_the_most_experts_whose_plan_fits_the_free_memory_with_headroom():
    gpu = gpu_module()
    plans, GiB = gpu.gpu_plans.read_plans()["plans"], 2 ** 30
    chosen = {}
    for name, gib in gpu.plan.GPU_MEMORY_GIB.items():
        free = int((gib - gpu.plan.CUDA_CONTEXT_GIB) * GiB)  # what torch can allocate, less this process's context
        experts, why = gpu.gpu_plans.choose_cut(plans, free)
        cfg = gpu.gpu_plans.wide_config("cuda", experts)
        need = gpu.gpu_plans.wide_need(cfg, plans[f"wide_{experts}"])[1]
        assert need * (1 + gpu.gpu_plans.HEADROOM) <= free and f"{experts} experts: plan" in why
        more = [e for e in gpu.gpu_plans.EXPERT_CUTS if e > experts]  # each larger cut was refused, and said so
        assert all(f"{e} experts: plan" in why and "> " in why for e in more), why
        chosen[name] = experts
    assert chosen == {"H100 80GB": 48, "H200 141GB": 128}  # all 128 experts plan more than an H100 holds
    assert gpu.gpu_plans.choose_cut(plans, 20 * GiB)[0] is None  # nothing fits: sections 3-6 are skipped


def test_the_gpu_check_writes_under_the_device_tools_out_folder(monkeypatch, tmp_path):
    gpu = gpu_module()
    monkeypatch.setenv("OUT", str(tmp_path))
    assert gpu.default_out(smoke=False) == str(tmp_path / "gpu.json")  # what comes back from the machine
    monkeypatch.delenv("OUT")
    assert gpu.default_out(smoke=False) == os.path.join(ROOT, "bench", "results", "gpu.json")
    # a smoke run never lands on the measured numbers (bench/smoke.py's scheme)
    assert gpu.default_out(smoke=True) == os.path.join(ROOT, "bench", "results", "gpu.smoke.json")


def test_the_watchdog_writes_what_was_read_and_ends_the_run_before_the_timeout(tmp_path):
    gpu = gpu_module()
    assert gpu.BUDGET_S < gpu.END_S <= gpu.TIMEOUT_S - 20  # the last section started has time, and the write too
    with open(os.path.join(ROOT, "docs", "gpus.md")) as f:  # the device command's timeout is the one the budget is for
        assert f"timeout {gpu.TIMEOUT_S} python3 bench/gpu.py --out $OUT/gpu.json" in f.read()
    out = tmp_path / "gpu.json"
    code = (f"import importlib.util, sys, time; spec = importlib.util.spec_from_file_location('g', {SCRIPT!r}); "
            f"g = sys.modules['g'] = importlib.util.module_from_spec(spec); spec.loader.exec_module(g); "
            f"r = g.Report({str(out)!r}, 100, {{}}); r.watch(1.0); "
            f"r.run('1. quick', lambda b: ([('done', 'yes')], {{}}), None); "
            f"r.run('2. stuck', lambda b: time.sleep(60), None)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == gpu.CUT_SHORT_EXIT, proc.stderr[-2000:]
    got = json.loads(out.read_text())
    assert got["cut_short"].startswith("2. stuck") and not got["done"] and list(got["sections"]) == ["<lambda>"]


@pytest.mark.slow
def test_the_gpu_check_runs_every_section_on_cpu_without_an_error_and_ends_with_the_headline(tmp_path):
    proc, got = run_check(tmp_path, "--quick", "--device", "cpu", "--config", os.path.join(ROOT, "configs", "tiny.py"))
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
    proc, got = run_check(tmp_path, "--quick")
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
