"""Scoring that cannot be broken (issue 25, causes 4 and 5).

4. The eval path scores as the RL step does, time-limited (reward.timeout_s): a completion whose
   scoring times out or raises counts as wrong, is counted (eval/unscored), and the run goes on.
5. A code answer sees only its own temp dir: a program that looks for the dataset, the tests,
   the repository or the host's files (by a known path, os.walk, glob, listing /tmp, /home or /,
   __main__'s __file__) earns nothing, while programs on the standard library still pass.
"""

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid

import pytest
import torch

import reward
import sandbox_child
from config import load_config
from data import CodeTask, Item, Task, MathTask
from evaluation import HeldOut, run_eval
from metrics import MetricsLog
from sampler import Rollout

TIMEOUT_S = 0.5  # reward.timeout_s of these runs: a degenerate completion costs this, twice (sampled and greedy)
SLOW_S = 3.0  # a verifier this slow would give reward 1.0, long after the limit


# ----------------------------------------------------------------------------- 4. the eval path

class ScriptedEngine:
    """Answers held-out item i with completion id i, whose text is texts[i], whatever the sampling."""

    def __init__(self, texts: list[str]):
        self.texts = texts

    def phase(self):
        return contextlib.nullcontext()

    def generate(self, prompts, params, *, n, seed, group_ids):
        return [Rollout(prompt_ids=p, completion_ids=[g], logprobs=torch.zeros(1), routes=torch.zeros(0),
                        finish_reason="length", group_id=g, weight_version=0, text=self.texts[g])
                for p, g in zip(prompts, group_ids) for _ in range(n)]


class CompletionTable:
    """A tokenizer whose completion ids index whole completions."""

    def __init__(self, texts: list[str]):
        self.texts = texts

    def prompt_ids(self, text, system="", tools=None):
        return [0]

    def decode(self, ids):
        return "".join(self.texts[i] for i in ids)


class VerifierStub(Task):
    """A verifier that raises on "raise", takes SLOW_S on "slow" (then says correct), and is right on "right"."""

    def __init__(self):
        self.items = [Item(f"q{i}", "", 0, i) for i in range(2)]

    def score(self, completion, item):
        if completion == "raise":
            raise ValueError("the verifier broke")
        if completion == "slow":
            time.sleep(SLOW_S)
        return 1.0 if completion in ("right", "slow") else 0.0


def math_task() -> MathTask:
    return MathTask([Item(f"q{i}", "1", 0, i) for i in range(2)])


@pytest.fixture(scope="module", autouse=True)
def math_verify_imported():
    # sympy's first import takes seconds, which time_limited lets finish: not inside a test's 0.5 s limit
    assert reward.math_reward("\\boxed{1}", "1") == 1.0


EVAL_CASES = {  # name: (task, the degenerate completion, the correct one, reward workers)
    "tower of exponents": (math_task, "\\boxed{9^{9^{9^{9}}}}", "\\boxed{1}", 0),
    "long run of braces": (math_task, "\\boxed{" + "{" * 3000 + "1" + "}" * 3000 + "}", "\\boxed{1}", 0),
    "huge binomial": (math_task, "\\boxed{\\binom{10^9}{10^8}}", "\\boxed{1}", 0),
    "huge factorial": (math_task, "\\boxed{(10^{10})!}", "\\boxed{1}", 0),
    "verifier raises": (VerifierStub, "raise", "right", 0),
    "verifier too slow": (VerifierStub, "slow", "right", 0),
    "verifier raises on reward workers": (VerifierStub, "raise", "right", 1),
    "verifier too slow on reward workers": (VerifierStub, "slow", "right", 1),
}


@pytest.mark.parametrize("case", EVAL_CASES)
def test_eval_counts_an_unscorable_completion_wrong_and_goes_on(case, tmp_path):
    make_task, bad, good, workers = EVAL_CASES[case]
    task = make_task()
    cfg = load_config(None, [f"out_dir={tmp_path}", f"reward.timeout_s={TIMEOUT_S}", f"reward.workers={workers}",
                             "eval_samples=1"])
    log = MetricsLog()
    # reward.workers > 0 sends the eval to workers of its own, as the run's own pool scores the training task
    out = run_eval(ScriptedEngine([bad, good]), CompletionTable([bad, good]), HeldOut(task, task.items), cfg, log,
                   step=0, t_start=0.0)
    assert list(out) == ["sampled", "greedy"] and out["sampled"].tolist() == out["greedy"].tolist() == [0.0, 1.0]
    assert log.records[-1]["eval/unscored"] == 2  # once sampled, once greedy


def test_prompt_only_held_out_prompts_print_why_no_accuracy_instead_of_a_table_of_zeros(tmp_path, capsys):
    """Issue 33: a run on prompt-only rows (reward.rm_only with a reward model; data.PromptTask, whose verifier pays
    0 whatever the answer) ends with one line saying accuracy is not measured and why, and the reward model's score
    it did measure, not a 0.000 -> 0.000 table as if RL did nothing; its evals generate and log nothing."""
    import train
    from runs import MICRO
    rows = [{"prompt": f"Tell me about the number {i}."} for i in range(40)]
    for name, part in (("train.jsonl", rows[:30]), ("eval.jsonl", rows[30:])):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in part))
    (tmp_path / "micro.py").write_text(MICRO)
    cfg = load_config(str(tmp_path / "micro.py"), [
        f"out_dir={tmp_path / 'run'}", f"train_data={tmp_path / 'train.jsonl'}", f"eval_data={tmp_path / 'eval.jsonl'}",
        "reward.rm_only=True", "reward.model=stub", "sft_steps=0", "rl_steps=2", "eval_every=1", "eval_size=4",
        "ckpt_every=0"])
    summary = train.main(cfg)
    out = capsys.readouterr().out
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    scores = [r["rm/score_mean"] for r in records if r["stage"] == "rl"]
    assert f"held-out accuracy: not measured: the held-out prompts (eval_data={tmp_path / 'eval.jsonl'}) are " \
           f"prompt-only rows, with no gold answer to grade; the reward model's mean score of the RL rollouts went " \
           f"{scores[0]:.3f} -> {scores[-1]:.3f} (rm/score_mean in metrics.jsonl)\n" in out
    assert "held-out accuracy (n=" not in out and "eval accuracy" not in out and "0.000 +- 0.000" not in out
    assert not [r for r in records if r["stage"] == "eval"] and "sampled" not in summary


# ----------------------------------------------------------------------------- 5. the sandbox's file system

LOOKUP = '''
import glob, json, os, re, sys

def answer_in(path):
    """The expected answer of `secret`, read out of a HumanEval JSONL row's test."""
    try:
        with open(path) as f:
            for line in f:
                row = json.loads(line)
                if row["entry_point"] == "secret":
                    return re.search(r"== '([^']*)'", row["test"]).group(1)
    except (OSError, ValueError, KeyError, AttributeError):
        return None
'''
DATA_NAME = "HumanEval.jsonl"
HOST_TMP = tempfile.gettempdir()


@pytest.fixture(scope="module")
def dataset():
    """A HumanEval-format dataset in the host's temp dir whose one problem only the file answers: its
    path and the problem (the test's expected value is a fresh token)."""
    folder = tempfile.mkdtemp(prefix="everyprompt-data-")
    os.chmod(folder, 0o755)  # as a dataset folder is: readable by every user
    problem = CodeTask("Leak/0", "def secret():\n    \"\"\"Return the secret.\"\"\"\n",
                       f"def check(candidate):\n    assert candidate() == 'tok-{uuid.uuid4().hex}'\n", "secret")
    path = os.path.join(folder, DATA_NAME)
    with open(path, "w") as f:
        f.write(json.dumps({"task_id": problem.task_id, "prompt": problem.prompt, "test": problem.test,
                            "entry_point": problem.entry_point}) + "\n")
    os.chmod(path, 0o644)
    yield path, problem
    shutil.rmtree(folder)


def lookup_program(search: str) -> str:
    """A completion defining secret() that answers from the dataset, found by `search` (a function body
    yielding candidate paths)."""
    body = textwrap.indent(textwrap.dedent(search).strip(), "        ")
    return (f"```python\n{LOOKUP}\ndef secret():\n    def candidates():\n{body}\n"
            f"    for path in candidates():\n        if (found := answer_in(path)):\n            return found\n```")


def seen_program(expression: str) -> str:
    """A completion defining secret() that returns what `expression` shows it of the host (None if refused)."""
    return (f"```python\n{LOOKUP}\ndef secret():\n    try:\n        return {expression}\n"
            f"    except OSError:\n        return None\n```")


def first_line(path: str) -> str:
    with open(path) as f:
        return f.readline()


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOOKUPS = {  # how a program finds the dataset
    "open the data by its path": "yield DATA",
    "os.walk from /": f"""
        for root, dirs, files in os.walk('/'):
            if root.count(os.sep) >= {HOST_TMP.count(os.sep) + 1}:  # deep enough for a folder in the temp dir
                dirs[:] = []
            yield from (os.path.join(root, name) for name in files if name == '{DATA_NAME}')
        """,
    "glob of the temp dir": f"yield from glob.glob('{HOST_TMP}/*/{DATA_NAME}')",
    "listing the temp dir": f"""
        for name in os.listdir('{HOST_TMP}'):
            yield os.path.join('{HOST_TMP}', name, '{DATA_NAME}')
        """,
}
SIGHTS = {  # what a program reads or lists of the host: (expression, what the host holds there)
    "glob of the repository's parent for its tests":
        (f"bool(glob.glob('{os.path.dirname(REPO)}/*/tests/test_sandbox.py'))", lambda: True),
    "reading __main__'s __file__ (sandbox_child.py)":
        ("open(sys.modules['__main__'].__file__).readline()", lambda: first_line(sandbox_child.__file__)),
    "open('/etc/passwd')": ("open('/etc/passwd').readline()", lambda: first_line("/etc/passwd")),
    "listing /home": ("sorted(os.listdir('/home'))", lambda: sorted(os.listdir("/home"))),
    "listing /": ("sorted(os.listdir('/'))", lambda: sorted(os.listdir("/"))),
}


@pytest.mark.parametrize("case", LOOKUPS)
def test_a_program_that_answers_from_the_dataset_on_disk_earns_nothing(case, dataset):
    path, problem = dataset
    program = lookup_program(LOOKUPS[case].replace("DATA", repr(path)))
    assert reward.code_reward(program, problem) == 0.0


@pytest.mark.parametrize("case", SIGHTS)
def test_a_program_that_reads_the_hosts_files_earns_nothing(case):
    expression, host = SIGHTS[case]
    try:
        expected = host()
    except OSError as e:  # nothing there on this host to see
        pytest.skip(f"the host has nothing to read for {case!r}: {e}")
    problem = CodeTask("Sight/0", "def secret():\n    pass\n",
                       f"def check(candidate):\n    assert candidate() == {expected!r}\n", "secret")
    assert reward.code_reward(seen_program(expression), problem) == 0.0


LEGIT = {  # programs on the standard library: (the function, a test of it)
    "math, itertools, collections, re": (
        "import collections, itertools, math, re\n"
        "def secret(text):\n"
        "    words = re.findall(r'[a-z]+', text.lower())\n"
        "    pairs = sum(1 for _ in itertools.combinations(words, 2))\n"
        "    return collections.Counter(words).most_common(1)[0][0], math.comb(len(words), 2) == pairs\n",
        "    assert candidate('A b a, C!') == ('a', True)\n"),
    "heapq, functools, bisect, fractions, decimal, statistics, json": (
        "import bisect, decimal, fractions, functools, heapq, json, statistics\n"
        "@functools.lru_cache(None)\n"
        "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
        "def secret(xs):\n"
        "    s = sorted(xs)\n"
        "    return [heapq.nsmallest(2, xs), bisect.bisect(s, 3), str(fractions.Fraction(1, 3) * 3),\n"
        "            str(decimal.Decimal(1) / 4), statistics.median(xs), json.loads(json.dumps(fib(30)))]\n",
        "    assert candidate([5, 1, 4, 2]) == [[1, 2], 2, '1', '0.25', 3.0, 832040]\n"),
    "hashlib, random, datetime, unicodedata (libraries loaded on import)": (
        "import datetime, hashlib, random, unicodedata\n"
        "def secret(s):\n"
        "    random.seed(0)\n"
        "    return (hashlib.sha256(s.encode()).hexdigest()[:8], unicodedata.name('a'),\n"
        "            datetime.date(2024, 1, 1).isoformat(), random.random() < 1)\n",
        "    assert candidate('x') == ('2d711642', 'LATIN SMALL LETTER A', '2024-01-01', True)\n"),
    "files in its own temp dir": (
        "import os, tempfile\n"
        "def secret(text):\n"
        "    with open('notes.txt', 'w') as f:\n        f.write(text)\n"
        "    with tempfile.TemporaryFile() as t:\n        t.write(b'x')\n"
        "    return open(os.path.join(os.getcwd(), 'notes.txt')).read()\n",
        "    assert candidate('kept') == 'kept'\n"),
}


@pytest.mark.parametrize("case", LEGIT)
def test_a_program_on_the_standard_library_still_passes(case):
    code, test = LEGIT[case]
    problem = CodeTask("Legit/0", "def secret(x):\n    pass\n", f"def check(candidate):\n{test}", "secret")
    assert reward.code_reward(f"```python\n{code}```", problem) == 1.0


def test_the_audit_hook_fallback_refuses_host_paths_processes_and_ctypes_but_not_the_stdlib(tmp_path):
    # where the kernel confines no reads (no namespaces, no Landlock) the program's process runs under this hook
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {REPO!r})
        import sandbox_child
        sandbox_child._audit_reads(os.getcwd())
        import decimal, hashlib, json
        open('mine.txt', 'w').write('x')
        assert open('mine.txt').read() == 'x' and os.listdir('.') == ['mine.txt']
        refused = []
        for attempt in (lambda: open('/etc/passwd'), lambda: os.listdir('/'), lambda: os.listdir({HOST_TMP!r}),
                        lambda: open(sandbox_child.__file__), lambda: os.chdir('/'),
                        lambda: __import__('subprocess').run(['true']), lambda: __import__('ctypes').CDLL(None)):
            try:
                attempt()
            except PermissionError:
                refused.append(True)
        assert len(refused) == 7, refused
        assert list(os.walk('/')) == []  # os.walk hides the refusal: it finds nothing
        print('ok')
        """)
    done = subprocess.run([sys.executable, "-I", "-c", script], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)
    assert done.stdout.strip() == "ok", done.stderr
