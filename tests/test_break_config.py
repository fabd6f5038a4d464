"""A config file that breaks out (issue 25): it is Python, so it can exit, be interrupted, or bind a
setting's name to a function, a class or a module. Each is refused by one ValueError naming the file
and line (an exit or any BaseException) or the setting and the value's type, which train.py's __main__
prints as one `config error:` line; none ends the run silently or leaves the default standing in.

BREAKS: a row is a config file's text and the words its error must hold, loaded by load_config. The
exits that would end pytest itself (os._exit) and the path a user sees run `python train.py` itself.
"""

import os
import subprocess
import sys

import pytest

from config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def row(text: str, *names: str, id: str):
    return pytest.param(text, names, id=id)


BREAKS = [
    # ------------------------------------------------ exits and interrupts: an error on the file's line
    row("import sys\nsys.exit(0)\n", "c.py', line 2", "SystemExit(0)", "may not end the run", id="sys.exit(0)"),
    row("lr = 1e-3\nexit()\n", "c.py', line 2", "SystemExit(None)", id="exit()"),
    row("raise SystemExit('done')\n", "c.py', line 1", "SystemExit('done')", id="raise-SystemExit"),
    row("seed = 1\nraise KeyboardInterrupt\n", "c.py', line 2", "KeyboardInterrupt", id="KeyboardInterrupt"),
    row("raise GeneratorExit('x')\n", "c.py', line 1", "GeneratorExit: x", id="GeneratorExit"),
    row("class Stop(BaseException):\n    pass\n\n\nraise Stop('custom')\n", "c.py', line 5", "Stop: custom",
        id="BaseException-subclass"),
    # ------------------------------------------------ a setting bound to a non-value: its rule names the type
    row("def lr():\n    return 1e-3\n", "lr=<function lr", "(a function)", id="field-def"),
    row("lr = lambda: 1e-3\n", "lr=<function <lambda>", "(a function)", id="field-lambda"),
    row("class seed:\n    pass\n", "seed=<class", "(a class)", id="field-class"),
    row("import functools\nlr = functools.partial(float, '1e-3')\n", "lr=functools.partial", "(a partial)",
        id="field-callable-object"),
    row("from math import sqrt as grad_clip\n", "grad_clip=<built-in function sqrt>", id="field-builtin"),
    row("import os as model\n", "model=<module 'os'", "(a module)", "ModelConfig", id="section-module"),
    row("import filter\n", "filter=<module 'filter'", "(a module)", "FilterConfig", id="section-own-module"),
    row("def sampling():\n    return dict(top_k=5)\n", "sampling=<function sampling", "(a function)",
        id="section-def"),
    row("def tis_cap():\n    return 2.0\n", "tis_cap is loss.tis_cap", id="moved-key-def"),
]


def refusal(path: str) -> str:
    """The ValueError load_config raises for config file `path`; a test failure if it accepts the file
    or lets anything else escape (an exit or interrupt would otherwise end the test session itself)."""
    try:
        cfg = load_config(path, [])
    except ValueError as e:
        return str(e)
    except BaseException as e:  # noqa: BLE001  the bug under test: an exit or interrupt escaping the loader
        pytest.fail(f"{type(e).__name__}({e}) escaped load_config instead of a ValueError")
    pytest.fail(f"accepted: lr={cfg.lr}, seed={cfg.seed}")


@pytest.mark.parametrize("text,names", BREAKS)
def test_config_file_that_breaks_out_is_refused_by_name(tmp_path, text, names):
    path = tmp_path / "c.py"
    path.write_text(text)
    message = refusal(str(path))
    for name in names:
        assert name in message, message


@pytest.mark.parametrize("text,line", [
    ("import sys\nsys.exit(0)\n", "line 2: SystemExit(0)"),
    ("import os\nos._exit(0)\n", "line 2: os._exit(0)"),  # would end the process past any handler
    pytest.param("raise KeyboardInterrupt\n", "line 1: KeyboardInterrupt", marks=pytest.mark.slow),  # as sys.exit
], ids=["sys.exit", "os._exit", "KeyboardInterrupt"])
def test_train_py_prints_one_config_error_line_for_an_exit_in_the_file(tmp_path, text, line):
    path = tmp_path / "c.py"
    path.write_text(text)
    done = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), str(path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    errors = [x for x in done.stderr.splitlines() if x.startswith("config error:")]
    assert len(errors) == 1 and line in errors[0], done.stderr


def test_imports_and_helpers_under_other_names_still_load(tmp_path):
    # the shipped configs' pattern (configs/100b.py, configs/smoke_gpu.py) plus modules, functions and
    # classes under names no setting has: the file's helpers, dropped
    path = tmp_path / "c.py"
    path.write_text("from configs.qwen3_30b_a3b import *  # noqa: F403\n"
                    "from configs.tiny import bpe_merges  # noqa: F401\n"
                    "import math\n"
                    "from math import sqrt\n\n\n"
                    "def double(x):\n    return 2 * x\n\n\n"
                    "class Recipe:\n    steps = 7\n\n\n"
                    "lr = sqrt(1e-12) * math.e / math.e\n"
                    "rl_steps = double(Recipe.steps)\n")
    cfg = load_config(str(path), ["dry_run=True"])  # the recipe's device is cuda: a dry run plans for it
    assert (cfg.lr, cfg.rl_steps, cfg.ep) == (pytest.approx(1e-6), 14, 8)


def test_os_exit_is_put_back_after_a_config_file_runs(tmp_path):
    real = os._exit
    path = tmp_path / "c.py"
    path.write_text("lr = learning_rate\n")
    with pytest.raises(ValueError, match="NameError"):
        load_config(str(path), [])
    assert os._exit is real
    load_config(None, [])
    assert os._exit is real
