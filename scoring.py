"""Scoring: verifiers run under time limits, and rollouts scored while generation goes on.

Owns how a verifier runs, not what it checks (reward.py's verifiers): `time_limited`
(fn(*args) within a limit, or `ScoreTimeout`), `score_inline` (one item on the calling
thread, train.py's inline path), `RewardPool` (workers that score submitted rollouts while
the caller keeps generating) and `grade_elsewhere` (math-verify in a grader process, for
reward.math_equal off the main thread). Inline or pooled, an exception, a non-finite value
or a timeout gives reward 0 with its reason ("ok", "timeout", "error: <type>"), never a
crash or a hang. No paper prescribes any of it: the means are CPython's signals, threads
and processes.

Notable choices:
1. Main-thread SIGALRM: on the main thread (inline scoring, a process-pool worker, a
   grader) a SIGALRM timer interrupts the call between bytecodes and inside CPython's
   big-integer power, which checks for signals. The alarm raises `_Expired`, a
   BaseException, since math-verify and sympy catch Exception broadly; it repeats every
   ALARM_REPEAT_S past the limit should a bare `except:` swallow it, and lets an import in
   progress finish (a half-initialised sympy would be rebuilt on the next import). Inside
   an active limit the enclosing one governs.
2. A grader process for math-verify off the main thread: there no signal can interrupt a
   call, and CPython's big-integer power (math-verify on 9^{9^{9^{9}}}) holds the GIL for
   minutes, stopping every thread of the process: the pool's watchdog and the generating
   caller too. So reward.math_equal, off the main thread, runs math-verify in a grader
   process (one per concurrent caller, kept for reuse) that stops itself at the thread's
   limit by its own SIGALRM, and is killed if still silent KILL_GRACE_S later.
3. Threads or processes: `RewardPool` uses threads by default, for verifiers that wait (a
   sandbox subprocess, a remote model, the math grader) or are quick; no thread is started
   per item. A thread cannot be killed: a watchdog gives an item that overruns reward 0 and
   puts a fresh runner in place of the stuck one, which is abandoned. processes=True runs
   the verifier in spawned worker processes (it and its arguments must pickle), where
   CPU-bound Python does not hold the caller's GIL and a stuck worker is killed and
   replaced. While a thread pool is open the GIL switch interval is at least
   GIL_SWITCH_INTERVAL_S, so workers recording a score do not interrupt generation mid-step.
4. Every submitted key gets exactly one reward: in thread mode an item's result is
   recorded by whoever removes its runner's entry from `_running` (the runner when the
   verifier returns, the watchdog when it overran), so `gather` waits without a timeout and
   never loses or doubles a rollout.
"""

from __future__ import annotations

import functools
import math
import multiprocessing
import queue
import signal
import sys
import threading
import time
from collections import Counter
from typing import Callable

# ----------------------------------------------------------------------------- time limits

class ScoreTimeout(TimeoutError):
    """A verifier ran out of time: RewardPool and score_inline make it reward 0, reason "timeout"."""


class _Expired(BaseException):
    """Raised by the alarm inside a time-limited call. Not an Exception: math-verify and sympy catch Exception
    broadly (around sympy's doit, say), which would swallow the interruption and compute on."""


# past its limit the alarm fires again this often, should a bare `except:` swallow one; not more often, so that
# the cleanup on the way out (a finally block: the sandbox killing its run) is not cut off in turn
ALARM_REPEAT_S = 1.0
KILL_GRACE_S = 1.0  # a worker process this far past its own time limit is stuck where no signal reaches: killed
_alarm_armed = False  # main thread: a time_limited call is running under SIGALRM
_thread_limit = threading.local()  # off the main thread: .deadline (time.monotonic()) of the enclosing limit


def _on_alarm(_signum, frame):
    if not _alarm_armed:  # an alarm already on its way when the call ended must not hit the caller
        return
    while frame is not None:
        # An import cut off halfway would leave its package half-initialised (sympy's classes made anew on the
        # next import, unlike the ones already in use): let it finish, the alarm repeats every ALARM_REPEAT_S
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return
        frame = frame.f_back
    raise _Expired


def time_limited(fn: Callable, *args, seconds: float):
    """fn(*args), which must finish within `seconds` or raise ScoreTimeout.

    On the main thread a SIGALRM timer interrupts the call between bytecodes and inside
    CPython's big-integer power, which checks for signals (where math-verify spends a
    huge exponent's time); it repeats every ALARM_REPEAT_S past the limit. Inside an
    active limit the enclosing one governs. Off the main thread no signal can interrupt
    fn: the limit becomes the thread's deadline, which reward.math_equal keeps (its
    grader process is killed at it); other verifiers run on, and RewardPool's watchdog abandons
    them at the limit.
    """
    global _alarm_armed
    if seconds <= 0:  # a zero timer would mean no timer at all
        raise ScoreTimeout(f"no time left ({seconds} s)")
    if threading.current_thread() is not threading.main_thread():
        outer = getattr(_thread_limit, "deadline", None)
        mine = time.monotonic() + seconds
        _thread_limit.deadline = mine if outer is None else min(outer, mine)
        try:
            return fn(*args)
        finally:
            _thread_limit.deadline = outer
    if _alarm_armed:
        return fn(*args)
    previous = signal.signal(signal.SIGALRM, _on_alarm)  # the process's one real-time timer is this call's now
    _alarm_armed = True
    try:
        try:
            signal.setitimer(signal.ITIMER_REAL, seconds, ALARM_REPEAT_S)  # inside: however soon it fires
            return fn(*args)
        finally:
            while True:  # an alarm that lands in here before the flag is down is caught, and this retried
                try:
                    _alarm_armed = False  # from here on the handler raises nothing
                    break
                except _Expired:
                    pass
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, signal.SIG_DFL if previous is None else previous)
    except _Expired:  # converted out here, once no alarm can interrupt the conversion
        raise ScoreTimeout(f"over {seconds} s") from None


def _seconds_left(default: float) -> float:
    """Off the main thread: the time to the enclosing limit's deadline, else `default`."""
    deadline = getattr(_thread_limit, "deadline", None)
    return default if deadline is None else deadline - time.monotonic()


def score_inline(fn: Callable[..., float], *args, timeout_s: float) -> tuple[float, str]:
    """fn(*args) on the calling thread, time-limited, as a RewardPool would score it: (reward, reason).

    For scoring without a pool (train.py's inline path): a verifier that raises, returns a
    non-finite value or runs past timeout_s gets reward 0 and the reason RewardPool gives
    ("error: <type>", "timeout"), never a hang (on the main thread; see time_limited).
    """
    return _call(functools.partial(time_limited, fn, seconds=timeout_s), args)


class _Worker:
    """A spawned process that answers fn(*args) requests on its main thread (_process_worker)."""

    def __init__(self, fn: Callable, limit_s: float | None):
        ctx = multiprocessing.get_context("spawn")  # fork is unsafe in a process running torch threads
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=_process_worker, args=(child_conn, fn, limit_s), daemon=True)
        self.proc.start()
        child_conn.close()
        try:
            self.conn.recv()  # "ready": start-up (imports) ends before an item's clock starts
        except BaseException:
            self.kill()
            raise

    def call(self, args: tuple, wait_s: float) -> tuple[float, str] | None:
        """fn's (reward, reason), or None if none came within wait_s (the process is then killed).

        Raises EOFError or OSError if the process died.
        """
        self.conn.send(args)
        if self.conn.poll(wait_s):  # blocks without the GIL; the worker's CPU time is its own process's
            return self.conn.recv()
        self.kill()
        return None

    def kill(self):
        self.proc.kill()  # a hung worker may be deep in C code: kill, not ask
        self.proc.join()


def _process_worker(conn, fn, limit_s):
    if limit_s is not None:  # on the process's main thread: a signal can stop fn at the limit, no kill needed
        fn = functools.partial(time_limited, fn, seconds=limit_s)
    conn.send("ready")  # sent once spawn has imported fn's module: the caller starts the item's clock after it
    while True:
        try:
            args = conn.recv()
        except EOFError:  # the caller's end of the pipe is gone: no more items will come
            return
        conn.send(_call(fn, args))


_idle_graders: dict[Callable, list[_Worker]] = {}  # work -> grader processes free for the next thread's call
_graders_lock = threading.Lock()


def _grade(work: Callable[[str, str], bool], answer: str, gold: str, seconds: float) -> bool:
    """A grader process's work: work(answer, gold) on its own main thread, limited by a signal."""
    return time_limited(work, answer, gold, seconds=seconds)


def grade_elsewhere(work: Callable[[str, str], bool], answer: str, gold: str, *, default_s: float) -> bool:
    """work(answer, gold) in a grader process (one per concurrent caller, kept for reuse), to the thread's limit.

    work is reward.math_equal's math-verify call, a module-level function (it must pickle).
    The limit is the enclosing time_limited's deadline, else default_s seconds. Raises
    ScoreTimeout past it, RuntimeError if the grader died or work raised.
    """
    # work is passed in, not imported: reward.py imports this file (time_limited, this function) and the grader
    # runs reward's math-verify call, so passing it keeps the dependency one way (reward -> scoring), and the
    # grader, unpickling work at spawn, still imports reward.py before "ready", outside an item's clock
    with _graders_lock:
        idle = _idle_graders.setdefault(work, [])
        grader = idle.pop() if idle else None
    if grader is None:  # a few seconds: the grader imports work's module, and math-verify on its first item
        grader = _Worker(functools.partial(_grade, work), None)
    seconds = _seconds_left(default_s)  # after the start-up, which may have used up the caller's limit
    result = (0.0, "timeout")
    if seconds > 0:
        try:
            # the grader stops itself at `seconds`; it is killed only if stuck where no signal reaches
            result = grader.call((answer, gold, seconds), seconds + KILL_GRACE_S)
        except (EOFError, OSError) as e:  # the grader died (out of memory, say)
            grader.kill()
            raise RuntimeError("math grader process died") from e
    if result is None:
        raise ScoreTimeout(f"math-verify over {seconds:.1f} s (grader killed)")
    with _graders_lock:
        _idle_graders[work].append(grader)
    value, reason = result
    if reason == "timeout":
        raise ScoreTimeout(f"math-verify over {seconds:.1f} s")
    if reason != "ok":
        raise RuntimeError(f"math grader: {reason}")
    return value == 1.0


# ----------------------------------------------------------------------------- overlapped scoring

def _call(fn: Callable[..., float], args: tuple) -> tuple[float, str]:
    try:
        value = float(fn(*args))
    except ScoreTimeout:
        return 0.0, "timeout"
    except Exception as e:  # a verifier's failure is reward 0, never a crash
        return 0.0, f"error: {type(e).__name__}"
    # a NaN or inf would reach its group's mean and std and make every advantage of that group NaN
    return (value, "ok") if math.isfinite(value) else (0.0, "error: non-finite reward")


GIL_SWITCH_INTERVAL_S = 0.05  # while a thread-mode RewardPool is open (see its docstring)


class RewardPool:
    """Scores submitted items on `workers` workers while the caller goes on (e.g. generating).

    fn(*args) -> float is the verifier. Threads (default) suit verifiers that wait (a
    sandbox subprocess, a remote model, math_equal's grader process) or are quick;
    processes=True runs fn in spawned worker processes (fn and args must pickle), where
    CPU-bound Python does not hold the caller's GIL. Each item's timeout counts from when
    a worker starts it. Thread mode calls fn on the worker thread itself, under
    time_limited (math_equal's grader keeps the limit), and a watchdog gives an item that
    overruns reward 0 ("timeout") and starts a fresh worker in place of the stuck one,
    which is abandoned (a thread cannot be killed; it ends on its own or with the process).
    A worker process stops fn itself at the timeout (a signal on its main thread) and is
    killed and replaced if still silent KILL_GRACE_S later. No thread is started
    per item: thread churn slows the generation it overlaps. While a thread-mode pool is
    open the interpreter's GIL switch interval is at least GIL_SWITCH_INTERVAL_S: at the
    default 5 ms, workers waking to record a score make the generating thread hand the
    GIL over mid-step (bench/reward_overlap.py measures the overlap); they get it anyway
    whenever a torch op releases it.
    `counts` tallies the reasons: "ok", "timeout", "error: <exception type>".

    Threads and locks: `_todo` (a queue.Queue, locked by itself) carries items and stop
    sentinels to the runners. `_cond` guards `_done`, `counts`, `_running` and `_runners`;
    the runners, the watchdog, `gather` and `close` take it. In thread mode an item's result
    is recorded by whoever removes its runner's entry from `_running`: the runner when fn
    returns, or the watchdog when the item overran; so every key gets exactly one reward.
    In process mode each runner thread owns one worker process and its pipe, unshared, and
    keeps the timeout itself (a process can be killed), so there is no watchdog.
    """

    def __init__(self, fn: Callable[..., float], *, workers: int, timeout_s: float, processes: bool = False):
        if workers < 1 or timeout_s <= 0:
            raise ValueError(f"need workers >= 1 and timeout_s > 0; got {workers}, {timeout_s}")
        self.fn, self.timeout_s, self.processes = fn, timeout_s, processes
        self.counts: Counter = Counter()
        self._todo: queue.Queue = queue.Queue()  # (key, args) items, then one None per runner at close
        self._done: dict = {}  # key -> (reward, reason), until gathered
        self._submitted: set = set()  # keys submitted and not yet gathered: gather refuses any other
        self._cond = threading.Condition()  # the one lock of the shared state; gather waits on it for results
        self._running: dict = {}  # thread-mode runner -> (key, start time) of the item it is scoring
        self._closed = threading.Event()  # stops the watchdog, once every runner has ended
        self._runners = [self._start_runner() for _ in range(workers)]  # the live runners; the watchdog swaps them
        self._watchdog, self._switch_interval = None, None
        if not processes:
            self._watchdog = threading.Thread(target=self._watch, daemon=True)
            self._watchdog.start()
            # process-wide: restored by close(). A thread that waits for the GIL asks its holder to drop it after
            # the interval; a longer one lets the generating thread finish more of a step before a worker that
            # only records a score takes the GIL (it also gets it whenever a torch op releases it)
            self._switch_interval = sys.getswitchinterval()
            sys.setswitchinterval(max(self._switch_interval, GIL_SWITCH_INTERVAL_S))

    def _start_runner(self) -> threading.Thread:
        # daemon: an abandoned runner stuck in fn must not keep the interpreter from exiting
        t = threading.Thread(target=self._runner, daemon=True)
        t.start()
        return t

    def submit(self, key, *args):
        """Queue fn(*args) under `key` (hashable, unique among keys not yet gathered); returns at once.
        Raises ValueError on a key already waiting to be gathered (its first result would be lost)."""
        with self._cond:
            if key in self._submitted:
                raise ValueError(f"RewardPool.submit: key {key!r} is already submitted and not yet gathered")
            self._submitted.add(key)
        self._todo.put((key, args))

    def gather(self, keys: list) -> tuple[list[float], list[str]]:
        """Rewards and reasons for `keys`, in order, once all are scored; forgets them afterwards.
        Raises KeyError, at once, for a key never submitted (or already gathered): it would never come."""
        with self._cond:
            if missing := [k for k in keys if k not in self._submitted]:
                raise KeyError(f"RewardPool.gather: {len(missing)} keys were never submitted (or already gathered), "
                               f"e.g. {missing[0]!r}")
            # woken by every _finish; no timeout needed: every submitted key gets a result, a timed-out one too
            self._cond.wait_for(lambda: all(k in self._done for k in keys))
            out = [self._done.pop(k) for k in keys]
            self._submitted.difference_update(keys)
        return [r for r, _ in out], [why for _, why in out]

    def close(self):
        """Score what is queued, then stop the workers (a stuck one is timed out, not waited for)."""
        with self._cond:  # the watchdog may be swapping runners
            n = len(self._runners)
        for _ in range(n):  # queued behind the items, so every queued item is still scored
            self._todo.put(None)  # a runner replaced by the watchdog passes its stop on to its successor
        # join in short slices, re-reading the list: while a runner is stuck the watchdog must stay up to time
        # it out, and the runner it starts in its place has to be waited for too
        while True:
            with self._cond:
                live = [t for t in self._runners if t.is_alive()]
            if not live:
                break
            live[0].join(0.05)
        self._closed.set()  # only now: a stuck item during close is still timed out by the watchdog
        if self._watchdog is not None:
            self._watchdog.join()
        if self._switch_interval is not None:
            sys.setswitchinterval(self._switch_interval)
            self._switch_interval = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _finish(self, key, result):
        with self._cond:
            self._done[key] = result
            self.counts[result[1]] += 1
            self._cond.notify_all()  # gather() may wait for a different set of keys: wake every waiter

    def _runner(self):
        me, worker = threading.current_thread(), None  # worker: (process, connection) in process mode
        while (job := self._todo.get()) is not None:
            key, args = job
            if self.processes:
                try:
                    result, worker = self._in_process(args, worker)
                except Exception as e:  # e.g. args that do not pickle: still a reward, never a lost item
                    result = (0.0, f"error: {type(e).__name__}")
                self._finish(key, result)
                continue
            with self._cond:  # registered with the watchdog; the item's timeout counts from here
                self._running[me] = (key, time.monotonic())
            # on this thread: no thread per item, whose churn slows generation; time_limited hands the limit to
            # verifiers that keep it themselves (math_equal's grader), so they end when the watchdog gives up
            result = _call(functools.partial(time_limited, self.fn, seconds=self.timeout_s), args)
            with self._cond:
                abandoned = self._running.pop(me, None) is None  # the watchdog timed this item out
            if abandoned:
                return  # a fresh runner took this one's place
            self._finish(key, result)
        if worker is not None:  # the stop sentinel: end this runner's worker process with it
            worker.kill()

    def _watch(self):
        """Thread mode: time out items that overrun, replacing their runners."""
        # checked often enough that an item overruns its timeout by at most a tenth of it (or 50 ms)
        while not self._closed.wait(min(0.05, self.timeout_s / 10)):
            now = time.monotonic()
            with self._cond:
                late = [(t, key) for t, (key, start) in self._running.items() if now - start > self.timeout_s]
                for t, key in late:
                    # A thread cannot be killed: the stuck runner is abandoned (its entry gone, it discards its
                    # result and ends once fn returns) and a fresh one keeps `workers` items in flight. The
                    # abandoned one never takes a stop sentinel; its successor takes the one meant for it.
                    del self._running[t]
                    self._runners.remove(t)
                    self._runners.append(self._start_runner())
            for _, key in late:  # the late items' one result each: their runners will discard theirs
                self._finish(key, (0.0, "timeout"))

    def _in_process(self, args: tuple, worker: _Worker | None) -> tuple[tuple[float, str], _Worker | None]:
        """Score in this runner's worker process (started on first use, replaced after a kill or death)."""
        try:
            if worker is None:
                worker = _Worker(self.fn, self.timeout_s)
            # the worker stops fn itself at timeout_s (a signal on its main thread); a worker still silent
            # KILL_GRACE_S later is stuck where no signal reaches and is killed
            result = worker.call(args, self.timeout_s + KILL_GRACE_S)
            if result is not None:
                return result, worker
            return (0.0, "timeout"), None
        except (EOFError, OSError):  # the worker exited or crashed (e.g. out of memory) mid-item
            if worker is not None:
                worker.kill()
            return (0.0, "error: worker died"), None
