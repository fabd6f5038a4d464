"""One live run per run folder: out_dir/run.lock (checkpoint.check_run_folder reads it before any work,
checkpoint.lock_run_folder takes it for the run).

One live run per folder: rank 0 creates out_dir/run.lock (O_EXCL) holding its pid, host and the
process's start time, and removes it at the end. A lock whose process is gone from this host (or
whose pid now names a process started later) is a killed run's: taken over with a warning. A
lock from another host cannot be checked from here: the error names it.
"""

import dataclasses
import json
import os
import socket
import time
import warnings

from metrics import WRITE_ERRNOS, write_error

LOCK_FILE = "run.lock"  # in out_dir while a run writes there: its pid, host and start (take_lock)
LOCK_WRITE_GRACE_S = 60.0  # a lock file still unreadable this long after it was made: its run died creating it


@dataclasses.dataclass
class RunLock:
    """out_dir/run.lock as take_lock wrote it; release() removes it if it is still this run's."""
    path: str
    text: str

    def release(self):
        try:
            with open(self.path) as f:
                if f.read() != self.text:  # not ours any more: leave it to its holder
                    return
            os.remove(self.path)
        except FileNotFoundError:
            pass
        except OSError as e:  # out_dir made unwritable during the run: say so, without hiding the run's own error
            warnings.warn(f"could not remove {self.path}: {e.strerror}; delete it before the next run", stacklevel=2)


def take_lock(out_dir: str, run: str) -> RunLock:
    """Create out_dir (if needed) and its lock file, exclusively: {pid, host, start, since, run}. A stale lock (its
    process gone from this host) is taken over with a warning naming it. Rank 0 only. Raises ValueError when a
    live run (or one on another host) holds it, WriteError when out_dir cannot be written."""
    path = os.path.join(out_dir, LOCK_FILE)
    me = {"pid": os.getpid(), "host": socket.gethostname(), "start": _process_start(os.getpid()),
          "since": time.strftime("%Y-%m-%d %H:%M:%S"), "run": run}
    text = json.dumps(me)
    try:
        os.makedirs(out_dir, exist_ok=True)
        for _ in range(3):  # after a stale lock is taken over, or its holder just removed it: once more
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                seen, holder, busy = lock_state(path)
                if busy:
                    raise ValueError(f"out_dir={out_dir!r} is in use: {busy}") from None
                if seen:
                    warnings.warn(f"{path}: left by pid {holder.get('pid', '?')} on {holder.get('host', '?')} "
                                  f"(since {holder.get('since', '?')}), which is no longer running; this run takes "
                                  f"it over", stacklevel=2)
                    _remove_stale(path, seen)
                continue
            try:
                os.write(fd, text.encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            return RunLock(path, text)
    except OSError as e:
        if e.errno in WRITE_ERRNOS:
            raise write_error(path, e) from None
        raise
    raise ValueError(f"out_dir={out_dir!r} is in use: another run took {path} while this one took over a stale one")


def lock_state(path: str) -> tuple[str, dict, str | None]:
    # (the lock file's text, its holder, why it keeps a new run out: None when there is none or it is stale)
    try:
        with open(path) as f:
            text = f.read()
        age = time.time() - os.path.getmtime(path)
    except FileNotFoundError:
        return "", {}, None
    try:
        holder = json.loads(text)
        pid, host = int(holder["pid"]), str(holder["host"])
    except (ValueError, KeyError, TypeError):  # made, not yet written; or its run died between the two
        busy = f"{path} is being taken by another run" if age < LOCK_WRITE_GRACE_S else None
        return text, {}, busy
    named = f"run {holder.get('run', '?')} (pid {pid} on host {host}, since {holder.get('since', '?')}) holds {path}"
    if host != socket.gethostname():
        return text, holder, (f"{named}, which this host ({socket.gethostname()}) cannot check; if that run has "
                              f"ended, delete {path}")
    if _running(pid, holder.get("start")):
        return text, holder, (f"{named}; two runs in one folder overwrite each other's checkpoints and metrics: "
                              f"wait for it to end, stop it, or write this run elsewhere")
    return text, holder, None


def _process_start(pid: int) -> str | None:
    # When process `pid` started (clock ticks since boot, /proc/<pid>/stat's 22nd field); None without /proc
    # or such a process. A pid's number is reused; its start time tells the processes apart.
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command's name, which may hold spaces
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else fields[19]  # a zombie has ended; only its exit status is left


def _running(pid: int, start: str | None) -> bool:
    # Whether process `pid` of this host, started at `start` (if known), still runs.
    if os.path.isdir("/proc/self"):
        now = _process_start(pid)
        return now is not None and (start is None or now == start)
    try:  # no /proc (macOS): signal 0 asks only whether the pid exists
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _remove_stale(path: str, seen: str):
    # Remove the stale lock whose text is `seen`, but never a fresh one another run made in the meantime: move it
    # aside (atomic), then put back what was moved if it is not what was seen.
    grave = f"{path}.stale{os.getpid()}"
    try:
        os.rename(path, grave)
    except FileNotFoundError:  # another run removed it first
        return
    with open(grave) as f:
        moved = f.read()
    if moved != seen:
        try:
            os.link(grave, path)
        except FileExistsError:
            pass
    os.remove(grave)
