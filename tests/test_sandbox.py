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
