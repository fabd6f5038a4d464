"""Run untrusted Python (a model's code answer plus its tests) in a confined subprocess.

Owns one run from start to cleanup: `run(program, limits, check=...)` writes the program
to a fresh temporary directory, starts sandbox_child.py as a child interpreter (`python -I
sandbox_child.py DIR LIMITS`) that confines itself and then runs the program, kills whatever is
left, deletes the directory and returns whether the program ran to its end, or with a
`Check` whether its tests passed, within `SandboxLimits` (`SandboxResult`, with the
confinement layers the host allowed). `reward.code_reward`,
the HumanEval-format verifier, is its caller. Like HumanEval's own harness (arXiv
2107.03374, "Evaluating Large Language Models Trained on Code") it is a guard for
model-written code, not a boundary for an attacker; no paper prescribes the layers, which
are Linux's namespaces(7), setrlimit(2), no_new_privs and Landlock.

"Process group" in this file is always the OS's (setsid(2), killpg(2)): the processes of
one run. It is never a group of rollouts.

The child's layers, each only where the host allows it, are in sandbox_child.py's docstring:
namespaces with a root of the program's own, rlimits, an unprivileged uid, Landlock, every
capability dropped, and an audit hook where nothing else confines reads. The child runs
with -I, so it cannot import this file: `SandboxLimits` and the names both sides use
(JOB_NAME, LAYERS_TAG, TIMEOUT_EXIT) are declared there and imported here.

Ending and judging a run:
1. The child keeps the wall-clock limit outside the namespaces: it kills the namespace's
   init and reaps it, which returns only once the kernel has killed every process in the
   namespace.
2. The parent, with a later backstop limit of its own, then kills the child's whole OS
   process group (its leader left unreaped until then, so the process-group id cannot
   have been reused) and deletes the temp dir.
3. The program counts as passed only if it runs to its end and the child then prints a
   nonce the program never sees as data, so `sys.exit(0)` or `os._exit(0)` before the
   tests run is a failure.
4. With a `Check` (HumanEval's check(candidate), `reward.code_reward`), the tests run
   apart from the program, in the child's runner process, and only plain data crosses
   between them; neither the nonce nor the test source is ever in the program's memory
   (sandbox_child.py's docstring, "A `Check`").

Limits of this design (those of the confinement and of a Check: sandbox_child.py's docstring):
1. Memory is bounded per process, so the worst case is max_processes x memory_mb; a
   cgroup would bound the sum.
2. Without namespaces (unprivileged user namespaces disabled) there is no network or PID
   isolation, a program that calls setsid leaves the OS process group the parent kills,
   and RLIMIT_NPROC counts all of the user's processes.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import sandbox_child
from sandbox_child import JOB_NAME, LAYERS_TAG, TIMEOUT_EXIT, SandboxLimits

PARENT_GRACE_S = 5.0  # the parent's own limit is wall_s plus this: a backstop should the child hang
# in the host's temp dir, not the program's tmpfs (the parent opens the child's stdout), so it outlives the mount
# namespace; RLIMIT_FSIZE bounds it
OUTPUT_NAME = "output.txt"


@dataclass(frozen=True)
class Check:
    """Tests run apart from the program (sandbox_child.py's docstring, "A `Check`").

    `test` defines check(candidate) (HumanEval's layout), which is called with a stand-in
    for the program's `entry_point` function (the name entry_point in the tests' namespace
    is that stand-in too); `context` is trusted code run before the tests in their
    namespace (HumanEval's prompt: helpers such as encode_cyclic that its tests call).
    The run passes if check returns.
    """
    test: str
    entry_point: str
    context: str = ""


@dataclass
class SandboxResult:
    passed: bool
    reason: str  # "passed", "timeout", "failed: <last output line>", "signal: SIGXCPU", "exited early"
    layers: list[str]  # protections the child applied
    output: str  # the last few kB of the program's stdout and stderr
    workdir: str  # the temp dir the run used (deleted on return)


def run(program: str, limits: SandboxLimits = SandboxLimits(), *, check: Check | None = None) -> SandboxResult:
    """Run `program` (Python source) confined as described in the module docstring.

    Without `check` it passes if it runs to its end; with one, if check(candidate) returns,
    candidate standing in for the program's check.entry_point. Never raises for anything
    the program does; returns passed=False with the reason.
    """
    tmp = tempfile.mkdtemp(prefix="everyprompt-sandbox-")
    try:
        with open(os.path.join(tmp, JOB_NAME), "w") as f:
            json.dump({"program": program, "entry_point": check.entry_point if check else None}, f)
        # handed over on stdin, which the runner reads before the program starts: in argv or the environment
        # the program could read it (/proc/self/cmdline, os.environ) and print it without running the tests
        nonce = secrets.token_hex(16)
        # nothing of the caller's environment (tokens, keys, PYTHONPATH) reaches the program
        env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp, "LANG": "C.UTF-8"}
        with open(os.path.join(tmp, OUTPUT_NAME), "wb") as out:
            # -I: no user site-packages, no PYTHON* variables, and not the child's directory on sys.path, so the
            # program cannot import the project's modules. start_new_session: the child leads a new OS process
            # group, so the killpg below reaches everything it started and nothing of the caller's.
            child = [sys.executable, "-I", os.path.abspath(sandbox_child.__file__), tmp, json.dumps(asdict(limits))]
            proc = subprocess.Popen(child, stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, cwd=tmp,
                                    env=env, start_new_session=True)
        try:
            try:
                # a Check's tests follow the nonce: like it they reach only the runner, never the program's memory,
                # where a program could read the expected values out of the test source
                tests = json.dumps({"test": check.test, "context": check.context}) + "\n" if check else ""
                proc.stdin.write(f"{nonce}\n{tests}".encode())
                proc.stdin.close()
            except BrokenPipeError:  # the child ended before the nonce was read; its exit code says why
                pass
            code = _wait_unreaped(proc.pid, limits.wall_s + PARENT_GRACE_S)  # the child keeps wall_s itself
        finally:  # also when the caller's own time limit interrupts the wait (scoring.time_limited)
            try:  # kill what is left in the child's OS process group (all of it without a PID namespace)
                os.killpg(proc.pid, signal.SIGKILL)  # the leader is a zombie at most: its group id is still ours
            except ProcessLookupError:
                pass
            proc.wait()  # reaped only now: the pid and process-group id may be reused from here on
        with open(os.path.join(tmp, OUTPUT_NAME), "rb") as f:
            header = f.readline(1024).decode(errors="replace")
            # only the last 4 kB: the output may be up to file_mb, and a failure's traceback ends it
            f.seek(max(f.tell(), os.fstat(f.fileno()).st_size - 4096))
            tail = f.read().decode(errors="replace")
        return _verdict(code, header, tail, nonce, tmp)
    finally:
        _remove_tree(tmp)


def _wait_unreaped(pid: int, timeout_s: float) -> int | None:
    """Exit code (128 + n for signal n) once pid exits, without reaping it; None after timeout_s."""
    deadline, pause = time.monotonic() + timeout_s, 0.002
    # polled with WNOWAIT, not Popen.wait(timeout), which would reap the child and free its pid (and with it
    # the OS process-group id) for reuse before run() kills that process group
    while True:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        if info is not None and info.si_pid == pid:
            return info.si_status if info.si_code == os.CLD_EXITED else 128 + info.si_status
        if time.monotonic() >= deadline:
            return None
        time.sleep(pause)
        pause = min(pause * 2, 0.02)  # a quick program is seen at once; a slow one costs few wake-ups


def _verdict(code: int | None, header: str, text: str, nonce: str, tmp: str) -> SandboxResult:
    """The run's outcome from its exit code (None: timed out) and its output's first line and tail."""
    layers = header[len(LAYERS_TAG):].strip().split(",") if header.startswith(LAYERS_TAG) else []
    lines = text.rstrip("\n").split("\n")
    if code is None or code == TIMEOUT_EXIT:  # None: the parent's backstop; 124: the child's own wall clock
        reason = "timeout"
    elif code == 0 and lines[-1] == nonce:
        return SandboxResult(True, "passed", layers, "\n".join(lines[:-1])[-4096:], tmp)
    elif code == 0:  # exit 0 without the nonce: the program ended the process (os._exit, say) before its end
        reason = "exited early"
    elif code > 128:  # killed by a signal: e.g. SIGXCPU at the soft CPU limit, SIGKILL at the hard one
        try:
            reason = f"signal: {signal.Signals(code - 128).name}"
        except ValueError:
            reason = f"signal: {code - 128}"
    else:  # the runner writes the exception last ("AssertionError: ..."): usually the most telling line
        last = next((ln for ln in reversed(lines) if ln.strip()), "")
        reason = f"failed: {last.strip()[:200]}"
    return SandboxResult(False, reason, layers, text[-4096:], tmp)


def _remove_tree(path: str):
    def make_writable(func, p, _exc):  # the program may have made its own files read-only
        os.chmod(os.path.dirname(p), stat.S_IRWXU)
        if os.path.isdir(p) and not os.path.islink(p):
            os.chmod(p, stat.S_IRWXU)
        func(p)
    shutil.rmtree(path, onerror=make_writable)
