"""Run outputs: metrics.jsonl (and TensorBoard or Weights & Biases when asked) and the end-of-run plot.

This file owns what a run reports. MetricsLog writes one JSON object per line to
out_dir/metrics.jsonl for every SFT step, RL step and eval, each with its "stage" ('sft',
'rl' or 'eval') and "step", mirrors the numeric values to the sink `logger` names, and
keeps every record in memory; plot draws the training reward, the held-out accuracy and
the zero-variance group fraction against the RL step at the end of a run.
Terms (step, zero-variance group) as the README's Legend defines them.

Notable choices:
1. metrics.jsonl is the record; TensorBoard and Weights & Biases only mirror it and are
   imported when asked for, so neither is a dependency.
2. Only rank 0 writes: the metrics are already reduced over ranks, so the ranks agree.
3. On resume the file is rewritten (atomically) with the records the checkpoint had seen, so a
   resumed run ends with the records an uninterrupted one would have, none twice. A killed run can
   leave a partial last line: reading drops it (read_records), and the resumed run says so.
4. A run's files are written whole or not at all: write_atomic writes a temporary file and renames
   it over the old one; a record's line is appended in one write and cut back off if it fails. A
   full disk, a read-only folder or a missing permission is a WriteError: one line naming the file
   (and for a full disk the bytes it needed), with nothing partial left behind.
5. The logger is checked before any work (check_logger): its package, and for wandb a login,
   so a run does not build its model only to fail at its first record.
"""

from __future__ import annotations

import errno
import importlib
import json
import netrc
import os
from urllib.parse import urlsplit

WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)
"""OSErrors that are the machine's answer, not a bug: a full disk or quota, a read-only filesystem, no permission."""
WANDB_HOST = "https://api.wandb.ai"  # wandb's default server (WANDB_BASE_URL overrides), whose netrc entry is a login


class WriteError(ValueError):
    """A run's file could not be written (a full disk, a read-only folder, no permission): one line naming it."""


def free_bytes(path: str) -> int:
    """Bytes free to this user on the filesystem that holds `path` (or would hold it: its nearest existing folder)."""
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def write_error(path: str, e: OSError, needed: int | None = None) -> WriteError:
    """The one-line WriteError for OSError `e` met writing `path`; `needed`: the bytes the write needed, if known."""
    what = f"{os.strerror(e.errno)} ({errno.errorcode.get(e.errno, e.errno)})" if e.errno else str(e)
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        try:
            free = f"{free_bytes(os.path.abspath(path)):,}"
        except OSError:
            free = "an unknown number of"
        what += f": it needs about {needed:,} bytes, {free} are free" if needed else f": {free} bytes are free"
    return WriteError(f"cannot write {path}: {what}")


def write_atomic(path: str, data: str | bytes):
    """Write `data` to `path` whole or not at all: a temporary file beside it, fsynced, renamed over it. Raises
    WriteError (WRITE_ERRNOS) with the temporary file removed and any earlier `path` as it was."""
    data = data.encode() if isinstance(data, str) else data
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        try:
            os.remove(tmp)
        except OSError:
            pass  # never made (no permission), or already gone
        if e.errno in WRITE_ERRNOS:
            raise write_error(path, e, len(data)) from None
        raise


def read_records(path: str) -> tuple[list[dict], str]:
    """The records of a metrics.jsonl, and a note of what was left out ("" if nothing): a partial last line (no
    newline: a run killed while writing it) and blank lines (two runs that wrote at once, before the run lock).
    Raises ValueError naming the file and line of any other line that is not a JSON object."""
    with open(path, "rb") as f:
        *lines, tail = f.read().split(b"\n")  # tail: b"" when the file ends with its newline
    records, blank = [], 0
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            blank += 1
            continue
        try:
            rec = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{path} line {i}: not a JSON record ({e}); repair or delete the line") from None
        if not isinstance(rec, dict):
            raise ValueError(f"{path} line {i}: a JSON {type(rec).__name__}, not a record")
        records.append(rec)
    notes = [f"{blank} blank line{'s' * (blank > 1)}"] if blank else []
    if tail.strip():
        try:
            rec = json.loads(tail)
        except ValueError:
            rec = None
        if isinstance(rec, dict):  # written whole but for its newline
            records.append(rec)
        else:  # cut short by a kill: the record is lost, the file is not
            notes.append(f"a partial last line ({len(tail)} bytes)")
    return records, " and ".join(notes)


def check_logger(logger: str):
    """That `logger` can log: its package imports, and for 'wandb' a login is at hand (WANDB_API_KEY, a netrc
    entry for its server) or WANDB_MODE logs offline. Raises ValueError saying what to do.
    Run before any work: otherwise the run learns it only when MetricsLog starts, after the model is built."""
    try:  # imported, not looked up: a package that is there but broken fails here too
        if logger in ("tensorboard", "wandb"):
            importlib.import_module({"tensorboard": "torch.utils.tensorboard", "wandb": "wandb"}[logger])
    except ImportError as e:  # a missing optional package is a config problem: say how to fix it
        raise ValueError(f"logger={logger!r} needs its package ({e}); pip install {logger}, "
                         f"or set logger=none") from None
    if logger == "wandb" and not _wandb_login():
        raise ValueError("logger='wandb': no Weights & Biases login (no WANDB_API_KEY, no netrc entry for "
                         f"{urlsplit(os.environ.get('WANDB_BASE_URL', WANDB_HOST)).hostname}); run `wandb login`, "
                         "set WANDB_API_KEY, set WANDB_MODE=offline to log locally, or set logger=none")


def _wandb_login() -> bool:
    # Where wandb.init finds a login, read without contacting the server (only it can say whether a key is valid):
    # its environment, then the netrc file `wandb login` writes. (wandb.api.api_key reads the same, but wandb
    # 0.31 prints that it is deprecated.)
    if (os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE")
            or os.environ.get("WANDB_MODE") in ("offline", "dryrun", "disabled")):
        return True
    host = urlsplit(os.environ.get("WANDB_BASE_URL", WANDB_HOST)).hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):  # no netrc file, or one that does not parse: no login there
        return False


class MetricsLog:
    """out_dir/metrics.jsonl, plus TensorBoard or Weights & Biases when `logger` asks ('none',
    'tensorboard', 'wandb'; its name is config.TrainConfig's rule). Without an out_dir the records are
    only kept in memory (`records`).

    write: whether this process writes (rank 0 only: the logged metrics are reduced over ranks, so rank
    0's records stand for all, and several writers would interleave their lines in one file).
    config: the run's resolved settings, for wandb's run page. keep: on resume, how many records of the
    existing metrics.jsonl to keep (those the checkpoint had seen); later ones are dropped and written
    again by the resumed run; a partial last line or blank lines are dropped with a note (read_records).
    Raises ValueError when the logger's package is not installed, WriteError when the file cannot be written.
    """

    def __init__(self, out_dir: str | None = None, *, logger: str = "none", config: dict | None = None,
                 keep: int | None = None, write: bool = True):
        self.records, self.backend = [], None
        self.enabled = out_dir is not None and write
        if out_dir is None:
            return
        self.path = path = os.path.join(out_dir, "metrics.jsonl")
        # Records past `keep` were logged after the checkpoint was written; the resumed run logs them
        # again, so they are left out here rather than written twice.
        if keep is not None and os.path.exists(path):
            self.records, dropped = read_records(path)
            if len(self.records) < keep and self.enabled:
                print(f"{path} holds {len(self.records)} records, the checkpoint had seen {keep}: the resumed run's "
                      f"file lacks {keep - len(self.records)} of them", flush=True)
            self.records = self.records[:keep]
            if dropped and self.enabled:
                print(f"{path}: dropped {dropped}; the resumed run goes on after its {len(self.records)} kept "
                      f"records", flush=True)
        if not self.enabled:
            return
        try:
            if keep is not None:  # the kept records replace the file whole, so a crash here loses none of them
                write_atomic(path, "".join(json.dumps(rec) + "\n" for rec in self.records))
            # unbuffered: each record reaches the file in the one write __call__ makes
            self.file = open(path, "ab" if keep is not None else "wb", buffering=0)
        except OSError as e:
            if e.errno in WRITE_ERRNOS:
                raise write_error(path, e) from None
            raise
        check_logger(logger)  # train.prepare has checked it before any work; a MetricsLog of its own checks it here
        if logger == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter
            self.backend = SummaryWriter(os.path.join(out_dir, "tensorboard"))
        elif logger == "wandb":
            import wandb
            self.backend = wandb.init(project="everyprompt", name=os.path.basename(os.path.abspath(out_dir)),
                                      dir=out_dir, config=config)

    def __call__(self, rec: dict):
        self.records.append(rec)
        if not self.enabled:
            return
        self._append((json.dumps(rec) + "\n").encode())  # as it comes, so a killed run keeps all it logged
        # Only numbers are curves; the stage prefix keeps SFT's loss apart from RL's, bool is left out
        # although it is an int, and "step" is the x-axis, not a curve.
        nums = {f"{rec.get('stage', 'run')}/{k}": v for k, v in rec.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}
        # Told apart by their methods, so neither package is imported here: TensorBoard's SummaryWriter
        # takes one scalar per call at the record's step; a wandb run takes the whole dict per call, at
        # wandb's own step counter (one per call), not at the record's step.
        if self.backend is not None and hasattr(self.backend, "add_scalar"):
            for k, v in nums.items():
                self.backend.add_scalar(k, v, global_step=rec.get("step", 0))
        elif self.backend is not None:
            self.backend.log(nums)

    def _append(self, line: bytes):
        # One line, whole or not at all: a write that fails midway (a full disk) is cut back off.
        end = os.fstat(self.file.fileno()).st_size
        try:
            view = memoryview(line)
            while view:  # an unbuffered write may take part of it; a regular file's rarely does
                view = view[self.file.write(view):]
        except OSError as e:
            try:
                self.file.truncate(end)
            except OSError:
                pass  # the file keeps a partial last line, which read_records drops on resume
            if e.errno in WRITE_ERRNOS:
                raise write_error(self.path, e, len(line)) from None
            raise

    def close(self):
        if self.enabled:
            self.file.close()
            if self.backend is not None:
                # SummaryWriter.close flushes its event file; a wandb run ends with finish().
                (self.backend.close if hasattr(self.backend, "add_scalar") else self.backend.finish)()


def plot(records: list[dict], path: str):
    """Training reward, eval accuracy (+- SE) and zero-variance fraction against RL step."""
    import matplotlib
    matplotlib.use("Agg")  # draws to files only: no display needed, as on a headless server
    import matplotlib.pyplot as plt
    rl = [r for r in records if r.get("stage") == "rl" and "reward" in r]  # a step with no rollouts has no reward
    ev = [r for r in records if r.get("stage") == "eval"]
    fig, ax = plt.subplots(1, 3, figsize=(13, 3.6))
    ax[0].plot([r["step"] for r in rl], [r["reward"] for r in rl])
    ax[0].set(title="training reward (mean over rollouts)", xlabel="RL step")
    # Each accuracy's standard error is logged under the same name with "se" for "acc".
    for key, label in (("eval_acc", "sampled (mean@k)"), ("eval_greedy_acc", "greedy")):
        ax[1].errorbar([r["step"] for r in ev], [r[key] for r in ev], yerr=[r[key.replace("acc", "se")] for r in ev],
                       marker="o", capsize=3, label=label)
    ax[1].set(title="held-out accuracy (+- 1 SE)", xlabel="RL step")
    ax[1].legend()
    ax[2].plot([r["step"] for r in rl], [r["filter/zero_variance_frac"] for r in rl])
    ax[2].set(title="zero-variance group fraction", xlabel="RL step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)  # pyplot keeps every figure alive until closed
