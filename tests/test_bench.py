"""Every bench in bench/ runs, so an API change cannot break one silently (issue 31): each script's `--smoke`
mode (its own code path at tiny sizes, bench/smoke.py) runs here in a fresh process, ends with its headline
line, which begins with the headline ratio, and writes its results where `--out` points, never over the
measured numbers in bench/results/. No timing is checked: a smoke run's numbers mean nothing.

The smoke runs start together, SMOKE_AT_ONCE at a time, the slowest first (most run one thread, and a CI
machine has 2 cores); each test waits for its own script's run."""

import argparse
import concurrent.futures
import fnmatch
import json
import os
import re
import subprocess
import sys

import pytest

from bench import smoke  # bench/smoke.py (bench/ itself on sys.path would shadow model.py with bench/model.py)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")

# each bench's headline, after its ratio: the line its real run ends with
HEADLINES = {
    "continuous.py": "tokens/s with continuous batching over a paged KV cache",
    "loss.py": "loss+backward vs per-sequence loop",
    "memory.py": "planned/measured peak memory",
    "mismatch.py": "lower train-inference KL with router replay",
    "model.py": "tokens/s vs transformers Qwen3-MoE",
    "reward_overlap.py": "of reward time hidden behind generation",
    "rollout.py": "decode tokens/s vs transformers generate",
    "scheduler.py": "rollout wall time, length-aware vs FIFO generation batches",
    "trl.py": "RL step throughput vs TRL GRPOTrainer",
    "weight_sync.py": "less time for the sharded engine's rollout-phase gather",
    "zve.py": "generated tokens per informative group, staged vs DAPO dynamic sampling",
}
# scripts whose --smoke another test file runs, and which (gpu.py's: with torchtitan hidden, as on the lent box)
SMOKE_ELSEWHERE = {"gpu.py": "tests/test_gpu.py"}
# the longest smoke runs (processes of their own, or several train.py runs): started first, so none trails alone
SLOWEST_FIRST = ("memory.py", "trl.py", "weight_sync.py", "scheduler.py")
SMOKE_AT_ONCE = 2  # most smoke runs use one thread, and a CI machine has 2 cores
RATIO = re.compile(r"-?\d+(\.\d+)?(x|%) ")  # "2.33x ...", "80.0% ...": the line begins with the headline ratio
SMOKE_TIMEOUT_S = 600  # far above a smoke run's seconds: a hung bench fails instead of stalling the suite


def scripts() -> list[str]:
    """bench/*.py that run as a script (an `if __name__ == "__main__":`); the rest are helpers."""
    out = []
    for name in sorted(os.listdir(BENCH)):
        if name.endswith(".py"):
            with open(os.path.join(BENCH, name)) as f:
                if 'if __name__ == "__main__":' in f.read():
                    out.append(name)
    return out


def read_bytes(path: str) -> bytes | None:
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return f.read()


def kept_results(script: str) -> tuple[bytes | None, bytes | None]:
    """The bytes of bench/results/<name>.json (the measured numbers) and <name>.smoke.json (None: no such file)."""
    name = script.removesuffix(".py")
    return tuple(read_bytes(os.path.join(smoke.RESULTS, f"{name}{suffix}")) for suffix in (".json", ".smoke.json"))


def run_smoke(script: str, out: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(BENCH, script), "--smoke", "--out", out],
                          capture_output=True, text=True, cwd=ROOT, timeout=SMOKE_TIMEOUT_S)


@pytest.fixture(scope="module")
def smoke_runs(request, tmp_path_factory):
    """script -> (kept_results before any run, its --out path, a future of its finished process), for the scripts
    whose smoke test this session runs, started SMOKE_AT_ONCE at a time, the slowest first."""
    smoke_test = test_each_bench_smoke_run_ends_with_its_headline_and_writes_only_where_told.__name__  # below
    chosen = {item.callspec.params["script"] for item in request.session.items
              if getattr(item, "originalname", None) == smoke_test}
    order = [s for s in SLOWEST_FIRST if s in chosen] + sorted(chosen - set(SLOWEST_FIRST))
    before = {script: kept_results(script) for script in order}
    folder = tmp_path_factory.mktemp("smoke")
    pool = concurrent.futures.ThreadPoolExecutor(SMOKE_AT_ONCE)
    try:
        runs = {}
        for script in order:
            out = str(folder / script.replace(".py", ".json"))
            runs[script] = (before[script], out, pool.submit(run_smoke, script, out))
        yield runs
    finally:  # after a failure under -x: the runs not yet started never start
        pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("script", sorted(HEADLINES), ids=lambda s: s.removesuffix(".py"))
def test_each_bench_smoke_run_ends_with_its_headline_and_writes_only_where_told(script, smoke_runs):
    before, out, run = smoke_runs[script]
    proc = run.result()
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert RATIO.match(last) and HEADLINES[script] in last, last
    with open(out) as f:
        assert json.load(f)  # the results, where --out points
    assert kept_results(script) == before  # the measured numbers untouched, no default smoke file written


def test_every_bench_script_has_a_smoke_mode_that_these_tests_run():
    found = scripts()
    assert set(SMOKE_ELSEWHERE) <= set(found), f"stale entries: {sorted(set(SMOKE_ELSEWHERE) - set(found))}"
    for script in found:
        with open(os.path.join(BENCH, script)) as f:
            assert "--smoke" in f.read(), f"bench/{script} has no --smoke"
        if script in SMOKE_ELSEWHERE:
            with open(os.path.join(ROOT, SMOKE_ELSEWHERE[script])) as f:
                assert '"--smoke"' in f.read(), f"{SMOKE_ELSEWHERE[script]} does not run bench/{script} --smoke"
        else:
            assert script in HEADLINES, f"bench/{script} has a --smoke that no test runs: add its headline to HEADLINES"
    assert set(HEADLINES) <= set(found), f"no such bench scripts: {sorted(set(HEADLINES) - set(found))}"


def test_a_smoke_run_writes_beside_the_measured_results_under_a_name_git_ignores(tmp_path):
    def path(**kw):
        return smoke.results_path(argparse.Namespace(**{"smoke": False, "out": "", **kw}), "loss")
    assert path() == os.path.join(smoke.RESULTS, "loss.json")
    assert path(smoke=True) == os.path.join(smoke.RESULTS, "loss.smoke.json")
    elsewhere = str(tmp_path / "made" / "x.json")
    assert path(smoke=True, out=elsewhere) == elsewhere and os.path.isdir(tmp_path / "made")
    with open(os.path.join(ROOT, ".gitignore")) as f:
        patterns = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    relative = os.path.relpath(path(smoke=True), ROOT)
    assert any(fnmatch.fnmatch(relative, p) for p in patterns), (relative, patterns)
    assert not any(fnmatch.fnmatch(os.path.relpath(path(), ROOT), p) for p in patterns)
