"""The sandbox: model-written code gets reward 0 for escaping, and the host is left as it was."""

import os
import socket
import tempfile
import uuid

import pytest

import sandbox

FAST = sandbox.SandboxLimits(wall_s=3, cpu_s=1, max_processes=4, memory_mb=256)


@pytest.fixture(scope="module")
def layers():
    result = sandbox.run("pass", FAST)
    assert result.passed, result.output
    return set(result.layers)


def processes_mentioning(text: str) -> list[int]:
    """Host pids whose command line contains text (the sandbox child's holds its temp dir)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    found.append(int(pid))
        except OSError:  # gone meanwhile
            pass
    return found


def mounts() -> str:
    with open("/proc/self/mountinfo") as f:
        return "".join(line for line in f if "everyprompt-sandbox" in line)


def assert_host_clean(result: sandbox.SandboxResult):
    assert not os.path.exists(result.workdir)
    assert processes_mentioning(result.workdir) == []
    assert mounts() == ""


def test_program_that_runs_to_its_end_passes_and_a_failing_one_does_not():
    ok = sandbox.run("x = sum(range(10))\nassert x == 45\nprint('done')", FAST)
    assert ok.passed and ok.reason == "passed" and ok.output.strip() == "done"
    bad = sandbox.run("assert 1 + 1 == 3, 'arithmetic'", FAST)
    assert not bad.passed and bad.reason == "failed: AssertionError: arithmetic"
    assert_host_clean(bad)


@pytest.mark.parametrize("exit_early", ["import sys; sys.exit(0)", "import os; os._exit(0)", "raise SystemExit"])
def test_exiting_before_the_tests_run_is_not_a_pass(exit_early):
    result = sandbox.run(exit_early + "\nassert False", FAST)
    assert not result.passed


def test_infinite_loop_is_stopped_by_the_cpu_limit_and_leaves_no_process():
    result = sandbox.run("while True:\n    pass", FAST)
    assert not result.passed and result.reason in ("signal: SIGXCPU", "timeout")
    assert_host_clean(result)


def test_sleeping_forever_is_stopped_by_the_wall_clock_limit():
    result = sandbox.run("import time\ntime.sleep(3600)", sandbox.SandboxLimits(wall_s=1, cpu_s=1))
    assert not result.passed and result.reason == "timeout"
    assert_host_clean(result)


def test_allocating_ten_gigabytes_fails_inside_the_sandbox():
    result = sandbox.run("buf = bytearray(10 * 2**30)\nbuf[-1] = 1", FAST)
    assert not result.passed and "MemoryError" in result.reason
    assert_host_clean(result)


def test_fork_bomb_is_bounded_by_the_process_limit_and_fully_killed(layers):
    if not layers & {"uid", "userns"}:
        pytest.skip(f"process limit not enforceable on this host (layers {sorted(layers)})")
    bomb = ("import os\n"
            "while True:\n"
            "    try:\n"
            "        if os.fork() == 0:\n"
            "            os.write(1, b'forked\\n')\n"
            "    except OSError:\n"
            "        pass\n")
    result = sandbox.run(bomb, sandbox.SandboxLimits(wall_s=2, cpu_s=1, max_processes=4, memory_mb=256))
    assert not result.passed
    assert result.output.count("forked") <= 3  # the program itself plus at most three more tasks
    assert_host_clean(result)


def test_writing_outside_the_temp_dir_is_refused(layers):
    if "landlock-fs" not in layers:
        pytest.skip(f"no Landlock on this host (layers {sorted(layers)})")
    target = os.path.join(tempfile.gettempdir(), f"everyprompt-escape-{uuid.uuid4().hex}")
    program = f"open({target!r}, 'w').write('escaped')\nopen('inside.txt', 'w').write('fine')"
    result = sandbox.run(program, FAST)
    assert not result.passed and "PermissionError" in result.reason
    assert not os.path.exists(target)
    assert_host_clean(result)


def test_network_connection_to_the_host_never_arrives(layers):
    if not layers & {"netns", "landlock-tcp"}:
        pytest.skip(f"no network isolation on this host (layers {sorted(layers)})")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()  # the kernel completes handshakes into the backlog without accept()
        port = server.getsockname()[1]
        program = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\nassert s.recv(2) == b'hi'"
        result = sandbox.run(program, FAST)
        server.setblocking(False)
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing ever arrived
    assert not result.passed
    assert_host_clean(result)


def test_the_program_cannot_import_the_projects_modules_nor_see_the_callers_environment(monkeypatch):
    # the child is sandbox_child.py, started with -I beside the project's files: neither it nor the program
    # finds them on sys.path, and the program's environment is the few variables sandbox.run sets
    monkeypatch.setenv("EVERYPROMPT_SECRET", "not for the program")
    monkeypatch.setenv("PYTHONPATH", os.path.dirname(os.path.abspath(sandbox.__file__)))
    program = ("import os\n"
               "for name in ('sandbox', 'sandbox_child', 'rules'):\n"
               "    try:\n        __import__(name)\n    except ImportError:\n        continue\n"
               "    raise AssertionError(f'imported {name}')\n"
               "assert sorted(os.environ) == ['HOME', 'LANG', 'PATH', 'TMPDIR'], sorted(os.environ)\n")
    result = sandbox.run(program, FAST)
    assert result.passed, result.output


# ----------------------------------------------------------------------------- a Check: tests apart from the program

def check_of(test: str, entry_point: str = "f", context: str = "") -> sandbox.Check:
    return sandbox.Check(test, entry_point, context=context)


def test_a_check_passes_only_when_its_tests_hold_against_the_programs_function():
    check = check_of("def check(candidate):\n    assert candidate(2) == 4\n")
    ok = sandbox.run("def f(x):\n    return x * x\n", FAST, check=check)
    assert ok.passed, ok.output
    bad = sandbox.run("def f(x):\n    return x + 1\n", FAST, check=check)
    assert not bad.passed and bad.reason == "failed: AssertionError:"
    assert_host_clean(bad)


def test_plain_data_crosses_to_the_program_and_back_with_its_exact_types():
    value = '{"t": (1, 2.5, None, True), frozenset({1}): [b"\\x00", 1 + 2j, {3}], "big": 10 ** 5000, "neg": -0.0}'
    test = ("import math\n"
            f"VALUE = {value}\n"
            "def check(candidate):\n"
            "    got = candidate(VALUE, key='k')\n"
            "    assert got == (VALUE, 'k') and type(got[0]['t']) is tuple and type(got[0][frozenset({1})][2]) is set\n"
            "    assert type(got[0]['t'][3]) is bool and math.copysign(1, got[0]['neg']) == -1\n"
            "    assert math.isnan(candidate(float('nan'), key=None)[0])\n")
    result = sandbox.run("def f(x, key):\n    return x, key\n", FAST, check=check_of(test))
    assert result.passed, result.output


def test_a_value_rigged_to_equal_anything_is_refused_even_inside_a_container():
    program = "class Any:\n    def __eq__(self, other):\n        return True\ndef f():\n    return [1, Any()]\n"
    test = "def check(candidate):\n    try:\n        assert candidate() == [1, 2]\n    except Exception:\n        pass\n"
    result = sandbox.run(program, FAST, check=check_of(test))
    assert not result.passed and result.reason == "failed: NotPlainData: f returned a list, not plain data"


def test_a_builtins_subclass_arrives_as_its_base_types_value_whatever_its_eq_says():
    program = ("import collections\nclass Int(int):\n    def __eq__(self, other):\n        return True\n"
               "Pair = collections.namedtuple('Pair', 'a b')\n"
               "def f(x):\n    return Int(x), Pair(x, x), collections.Counter('aab')\n")
    test = ("def check(candidate):\n    n, pair, counts = candidate(3)\n"
            "    assert type(n) is int and n != 4 and n == 3\n"
            "    assert type(pair) is tuple and pair == (3, 3) and type(counts) is dict and counts == {'a': 2, 'b': 1}\n")
    result = sandbox.run(program, FAST, check=check_of(test))
    assert result.passed, result.output


def test_the_functions_exception_reaches_the_tests_as_the_builtin_of_that_name():
    test = "def check(candidate):\n    try:\n        candidate(-1)\n    except ValueError as e:\n        assert str(e) == 'negative'\n" \
           "    else:\n        raise AssertionError('no ValueError')\n"
    result = sandbox.run("def f(x):\n    raise ValueError('negative')\n", FAST, check=check_of(test))
    assert result.passed, result.output


NONCE_PRINTER = ("import gc, os, re, sys\nfound, frame = [], sys._getframe()\n"
                 "while frame:\n    found += [v for v in frame.f_locals.values() if isinstance(v, str)]\n"
                 "    frame = frame.f_back\n"
                 "found += [v for o in gc.get_objects() if isinstance(o, dict) for v in o.values() if isinstance(v, str)]\n"
                 "print('\\n'.join(v for v in found if re.fullmatch('[0-9a-f]{32}', v)), flush=True)\nos._exit(0)\n")


def test_a_program_that_prints_the_runners_nonce_passes_only_without_a_check():
    # without a Check the nonce is a local of the runner's frame, below the program's
    # (sandbox_child.py's docstring, limit 2); with one it never enters the program's process
    assert sandbox.run(NONCE_PRINTER, FAST).passed
    result = sandbox.run(NONCE_PRINTER + "def f():\n    return 1\n", FAST, check=check_of("def check(c):\n    assert c() == 1\n"))
    assert not result.passed and "ProgramEnded" in result.reason


def test_the_program_cannot_read_the_runners_stdin_or_memory():
    program = ("import os\n"
               "def f(name):\n"
               "    try:\n"
               "        with open(f'/proc/{os.getppid()}/{name}', 'rb') as file:\n"
               "            return file.read(1).hex()\n"
               "    except OSError as e:\n"
               "        return type(e).__name__\n")
    test = "def check(candidate):\n    assert candidate('fd/0') == candidate('mem') == 'PermissionError'\n"
    result = sandbox.run(program, FAST, check=check_of(test))
    assert result.passed, result.output
