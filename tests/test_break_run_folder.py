"""The run folder holds one run, and says so (issue 25): each way of breaking it, as a user or a crash
would, ends in one exact outcome.

One table, BREAK. A row sets up copies of a finished micro run's folder (and the folders around it)
and the settings of a new run into it, and names the outcome:
- refused: train.main raises one ConfigError line holding every given word, before any work
  (train.run never starts, no lock of this run is left);
- continues: train.run starts (here a stand-in that builds the run with train.start_run: policy,
  engine, metrics log; no step), then the row's own check;
- raises: a direct call, ended as a full disk ends it: one ValueError line holding the words, and
  nothing partial left.
Every row fails on the code before the run-folder checks (checkpoint.check_run_folder, run_lock.take_lock,
the settings check in resume_checkpoint, metrics.read_records and WriteError, check_logger, the
dry run's prepare). Only names that code has are imported, so there the table runs and fails row
by row.
"""

import dataclasses
import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import warnings
from types import SimpleNamespace
from typing import Callable

import pytest
import torch
from safetensors import SafetensorError

import checkpoint
import train
from config import ConfigError, TrainConfig, load_config, parse_args
from metrics import MetricsLog, WriteError
from model import Transformer
from plan import param_counts
from run_lock import take_lock
from runs import MICRO, make_run, micro_config

SHORT = ["sft_steps=2", "rl_steps=1", "ckpt_every=1", "eval_size=8", "eval_samples=1"]  # checkpoints 2 (SFT), 3 (RL)
NEWEST = "ckpt/step_00000003"  # after the one RL step, its eval logged: a resume from it keeps every record
TORN = b'{"stage": "rl", "st'  # what a kill in the middle of a record's write leaves
HOST = socket.gethostname()


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> str:
    """A finished micro run's folder (checkpoints 2 and 3, metrics.jsonl, the final model in the hub layout,
    which init_from and init_hf load) beside its config file micro.py. Rows spoil copies of it."""
    root = tmp_path_factory.mktemp("finished")
    (root / "micro.py").write_text(MICRO)
    train.main(parse_args([str(root / "micro.py"), f"out_dir={root / 'run'}", *SHORT]))
    return str(root)


@dataclasses.dataclass
class Workspace:
    """One row's folder: `run`, a copy of the finished run; `init`, another copy, a checkpoint to start from."""
    tmp: str
    micro: str
    run: str
    init: str
    metrics: str  # the finished run's metrics.jsonl
    resume_changed: bool = False  # the flag config.py is to declare (see `attempt`)
    started: list = dataclasses.field(default_factory=list)  # (cfg, start) of each run train.main started
    lock_during: dict | None = None  # out_dir/run.lock while the run ran
    during: Callable | None = None  # called once inside the run
    seen: dict = dataclasses.field(default_factory=dict)

    def argv(self, *extra) -> list[str]:
        return [self.micro, f"out_dir={self.run}", *SHORT, *extra]

    def file(self, name: str, data: str | bytes) -> str:
        path = os.path.join(self.tmp, name)
        with open(path, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
        return path

    def lock(self, **holder) -> list[str]:
        """A run.lock in `run` as another run's take_lock would have left it; no settings of its own."""
        self.file("run/run.lock", json.dumps(holder))
        return []

    def start_run(self, cfg, start, meshes=None) -> dict:
        """train.run's stand-in: records the start, the lock, and builds the run (no step)."""
        self.started.append((cfg, start))
        lock = os.path.join(cfg.out_dir, "run.lock")
        if os.path.exists(lock):
            with open(lock) as f:
                self.lock_during = json.load(f)
        train.start_run(cfg, start, meshes).log.close()
        if self.during is not None:
            during, self.during = self.during, None
            during()
        return {}


@pytest.fixture
def ws(finished, tmp_path) -> Workspace:
    run, init = str(tmp_path / "run"), str(tmp_path / "init")
    shutil.copytree(os.path.join(finished, "run"), run)
    shutil.copytree(os.path.join(finished, "run"), init)
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return Workspace(str(tmp_path), os.path.join(finished, "micro.py"), run, init, f.read())


def refused(make, *names, id):
    return pytest.param(make, "refused", names, id=id)


def continues(make, check, id):
    return pytest.param(make, "continues", check, id=id)


def raises(call, *names, id):
    return pytest.param(call, "raises", names, id=id)


# ----------------------------------------------------------------------------- set-ups: make(ws, monkeypatch)

def changed_on_purpose(ws, mp):
    ws.resume_changed = True
    return ["resume=auto", "lr=1e-3"]


def held_by_a_live_process(ws, mp):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    ws.seen["stop"] = proc
    return ws.lock(pid=proc.pid, host=HOST, since="today")


def held_by_a_dead_process(ws, mp):
    proc = subprocess.Popen([sys.executable, "-c", ""])
    proc.wait()  # reaped: its pid names no process now
    ws.seen["pid"] = proc.pid
    return ws.lock(pid=proc.pid, host=HOST)


def held_by_a_reused_pid(ws, mp):  # this very process's pid, but a lock written by one started at another time
    ws.seen["pid"] = os.getpid()
    return ws.lock(pid=os.getpid(), host=HOST, start="1")


def a_second_run_meanwhile(ws, mp):
    def start_again():
        try:
            train.main(parse_args(ws.argv("resume=auto")))
        except ConfigError as e:
            ws.seen["second"] = str(e)
    ws.during = start_again
    return ["resume=auto"]


def init_from_inside_out_dir(ws, mp):
    shutil.copytree(ws.init, os.path.join(ws.run, "base"))
    return [f"init_from={ws.run}/base"]


def out_dir_links_to_init(ws, mp):
    os.symlink(ws.init, os.path.join(ws.tmp, "link"))
    return [f"init_from={ws.init}", f"out_dir={ws.tmp}/link"]


def read_only(ws, mp):  # a read-only filesystem's answer, which a chmod cannot give root
    ro, mkdir = os.path.join(ws.tmp, "ro"), os.mkdir
    os.makedirs(ro)

    def refuse(path, *args, **kwargs):
        if os.path.abspath(path).startswith(ro + os.sep):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
        return mkdir(path, *args, **kwargs)
    mp.setattr(os, "mkdir", refuse)
    return [f"out_dir={ro}/run"]


def little_room(ws, mp):
    mp.setattr(checkpoint, "free_bytes", lambda path: 1000, raising=False)
    return []


def fake_disk(mp, root, free: int):
    """The filesystem under `root` has `free` bytes left (os.statvfs says so); elsewhere the real one's."""
    statvfs = os.statvfs

    def fake(path):
        inside = os.path.abspath(path) == str(root) or os.path.abspath(path).startswith(f"{root}{os.sep}")
        return SimpleNamespace(f_bavail=free, f_frsize=1) if inside else statvfs(path)
    mp.setattr(os, "statvfs", fake)


def room_for_all_but_the_final_model(ws, mp):  # no checkpoints: only the final model is big
    fake_disk(mp, ws.tmp, 64 << 20)  # the small files' allowance (checkpoint.RUN_FILES_BYTES), no more
    return [f"out_dir={ws.tmp}/new", "ckpt_every=0"]


def torn_metrics(ws, mp):
    with open(os.path.join(ws.run, "metrics.jsonl"), "ab") as f:
        f.write(TORN)
    return ["resume=auto"]


def spoil_second_line(with_text):
    def make(ws, mp):  # "\n": what two runs writing at once left (one truncated the file the other appended to)
        first, rest = ws.metrics.split("\n", 1)
        ws.file("run/metrics.jsonl", first + "\n" + with_text + rest)
        return ["resume=auto"]
    return make


def bad_rates_dry_run(ws, mp):  # into a new folder: nothing else for the checks to find
    rates = ws.file("rates.jsonl", json.dumps({"id": "a", "pass_rate": 2}) + "\n")
    return [f"out_dir={ws.tmp}/new", "dry_run=True", "filter.skip_prob=0.5", f"filter.pass_rate_file={rates}"]


def no_wandb_login(ws, mp):
    for key in [k for k in os.environ if k.startswith("WANDB_")] + ["NETRC"]:
        mp.delenv(key, raising=False)
    mp.setenv("HOME", ws.tmp)  # no ~/.netrc there
    return ["logger=wandb"]


def disk_full_inside_a_save(ws, mp, error=None):
    def no_space(path, state):  # after the model and optimizer shards
        raise error or OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
    mp.setattr(checkpoint, "_write_trainer_state", no_space)
    out = os.path.join(ws.tmp, "save")
    cfg = load_config(ws.micro, [f"out_dir={out}"])
    model = Transformer(cfg.model)
    opt = train.sft_optimizer(model, cfg)
    sum(p.sum() for p in model.parameters()).backward()
    opt.step()  # state to save
    ws.seen["want_left"] = []  # no step_00000001.tmp, no step_00000001
    try:
        checkpoint.write_checkpoint(out, 1, model, opt, {"position": 1}, cfg)
    finally:
        ws.seen["left"] = os.listdir(os.path.join(out, "ckpt"))


def disk_full_as_torch_save_says(ws, mp):
    """torch.save's zip writer on a full disk (seen on a 1.4 MB tmpfs, torch 2.13): no errno, only a position that
    fell short; the disk is full as it fails."""
    room = iter([10**12])  # before the save (write_checkpoint looks first), then none
    mp.setattr(checkpoint, "free_bytes", lambda path: next(room, 0), raising=False)
    disk_full_inside_a_save(ws, mp, RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 "
                                                 "vs 598"))


class DiskFull:
    """A metrics file whose disk fills inside the next write: half the bytes land, then ENOSPC."""

    def __init__(self, path):
        self.f = open(path, "ab", buffering=0)

    def write(self, data):
        data = data.encode() if isinstance(data, str) else bytes(data)
        self.f.write(data[:len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self.f, name)


def disk_full_inside_a_record(ws, mp):
    log, path = MetricsLog(ws.tmp), os.path.join(ws.tmp, "metrics.jsonl")
    log({"stage": "sft", "step": 0, "loss": 1.0})
    log.file.close()
    log.file = DiskFull(path)
    ws.seen["want_left"] = '{"stage": "sft", "step": 0, "loss": 1.0}\n'  # whole lines only
    try:
        log({"stage": "sft", "step": 1, "loss": 0.5})  # 41 bytes as a line
    finally:
        log.file.f.close()
        with open(path) as f:
            ws.seen["left"] = f.read()


# ----------------------------------------------------------------------------- checks: check(ws, out, warned)

def resumed_with_the_new_lr(ws, out, warned):
    (cfg, start), = ws.started
    assert start.ckpt == os.path.join(ws.run, NEWEST)
    assert f"resume_changed=True: {ws.run}/{NEWEST} continues with changed settings (checkpoint -> this run: " \
           f"lr: 5e-05 -> 0.001)" in out
    assert json.load(open(os.path.join(ws.run, "run_config.json")))["lr"] == 0.001  # the folder says what runs


def took_over_the_stale_lock(ws, out, warned):
    assert [w for w in warned if "run.lock" in w] == [
        f"{ws.run}/run.lock: left by pid {ws.seen['pid']} on {HOST} (since ?), which is no longer running; "
        f"this run takes it over"]
    assert (ws.lock_during["pid"], ws.lock_during["host"]) == (os.getpid(), HOST)
    assert not os.path.exists(os.path.join(ws.run, "run.lock"))  # released at the end


def the_second_was_refused(ws, out, warned):
    assert ws.seen["second"].startswith(f"out_dir={ws.run!r} is in use: run ")
    assert f"(pid {os.getpid()} on host {HOST}, since " in ws.seen["second"]
    assert len(ws.started) == 1


def kept_every_record_once(note):
    def check(ws, out, warned):
        assert f"{ws.run}/metrics.jsonl: dropped {note}; the resumed run goes on after its" in out
        assert open(os.path.join(ws.run, "metrics.jsonl")).read() == ws.metrics
    return check


BREAK = [
    # ------------------------------------------------ whose run: a folder holds one; a resume continues only its own
    refused(lambda ws, mp: ["seed=7"], "holds another run's checkpoints", f"{NEWEST} -> this run: seed: 1337 -> 7",
            "resume=auto would continue theirs", id="fresh-run-with-another-seed"),
    refused(lambda ws, mp: ["filter.skip_prob=0.5"], f"{NEWEST} -> this run: filter.skip_prob: 0.0 -> 0.5",
            id="fresh-run-with-another-section-setting"),
    refused(lambda ws, mp: ["resume=auto", "seed=7"], "resume='auto': /", f"/run/{NEWEST} was written with other "
            "settings (checkpoint -> this run: seed: 1337 -> 7)", "resume_changed=True", id="resume-with-another-seed"),
    refused(lambda ws, mp: ["resume=auto", "lr=1e-3", "sft_lr=1e-2"], "sft_lr: 0.003 -> 0.01; lr: 5e-05 -> 0.001",
            id="resume-with-other-learning-rates"),
    refused(lambda ws, mp: [f"resume={ws.run}/{NEWEST}", "sampling.temperature=1.5"],
            f"/run/{NEWEST}': ", "sampling.temperature: 1.0 -> 1.5", id="resume-a-named-checkpoint-changed"),
    continues(changed_on_purpose, resumed_with_the_new_lr, id="resume-changed-on-purpose-says-what-changed"),
    # ------------------------------------------------ one live run a folder
    refused(held_by_a_live_process, "is in use: run ? (pid", f"on host {HOST}, since today) holds", "/run.lock",
            id="a-live-run-holds-the-folder"),
    continues(a_second_run_meanwhile, the_second_was_refused, id="a-second-run-while-the-first-runs"),
    refused(lambda ws, mp: ws.lock(pid=1, host="gpu-node-17", since="today"),
            "(pid 1 on host gpu-node-17, since today) holds", "cannot check; if that run has ended, delete",
            id="a-lock-from-another-host"),
    continues(held_by_a_dead_process, took_over_the_stale_lock, id="a-killed-runs-lock-is-taken-over"),
    continues(held_by_a_reused_pid, took_over_the_stale_lock, id="a-lock-whose-pid-was-reused-is-taken-over"),
    # ------------------------------------------------ apart from the checkpoint it starts from
    refused(lambda ws, mp: [f"init_from={ws.init}", f"out_dir={ws.init}"], "is the init_from folder",
            "would be written over it", id="out_dir-is-init_from"),
    refused(lambda ws, mp: [f"init_hf={ws.init}", f"out_dir={ws.init}", "max_prompt_tokens=0"], "is the init_hf folder",
            id="out_dir-is-init_hf"),
    refused(out_dir_links_to_init, "/link' is the init_from folder", id="out_dir-links-to-init_from"),
    refused(lambda ws, mp: [f"init_from={ws.init}", f"out_dir={ws.init}/run"], "is inside the init_from folder",
            id="out_dir-inside-init_from"),
    refused(init_from_inside_out_dir, "holds the init_from folder", id="init_from-inside-out_dir"),
    # ------------------------------------------------ a folder it can write, and room on its disk
    refused(lambda ws, mp: [f"out_dir={ws.file('a-file', 'x')}/run"], "a-file is a file, so no folder can be made",
            id="out_dir-under-a-file"),
    refused(lambda ws, mp: ["out_dir=/proc/everyprompt-run"], "cannot write in /proc", id="out_dir-in-proc"),
    refused(read_only, "cannot write in", "/ro: Read-only file system", id="out_dir-read-only"),
    refused(little_room, "1,000 bytes free on its filesystem; the run writes about 67,947,520 (the final model",
            "; 1 checkpoint at once (ckpt_every=1, ckpt_keep=2: 12 bytes a parameter): 619,776;",
            id="no-room-for-a-checkpoint"),
    refused(room_for_all_but_the_final_model, "/new': 67,108,864 bytes free on its filesystem; the run writes about "
            "67,327,744 (the final model (4 bytes a parameter, 51,648 of them): 206,592; tokenizer, metrics and config "
            "files: 67,121,152); free space, or write the run elsewhere", id="ckpt_every=0-no-room-for-the-final-model"),
    raises(disk_full_inside_a_save, "/save/ckpt/step_00000001.tmp: No space left on device (ENOSPC): it needs about",
           id="disk-full-inside-a-checkpoint-save"),
    raises(disk_full_as_torch_save_says, "step_00000001.tmp: No space left on device (ENOSPC): it needs about",
           id="disk-full-inside-a-save-as-torch-save-reports-it"),
    raises(disk_full_inside_a_record, "metrics.jsonl: No space left on device (ENOSPC): it needs about 41 bytes",
           id="disk-full-inside-a-metrics-record"),
    # ------------------------------------------------ the metrics.jsonl a resume continues
    continues(torn_metrics, kept_every_record_once(f"a partial last line ({len(TORN)} bytes)"),
              id="a-killed-runs-partial-last-line"),
    continues(spoil_second_line("\n"), kept_every_record_once("1 blank line"), id="a-blank-line-two-runs-left"),
    refused(spoil_second_line("{oops\n"), "metrics.jsonl line 2: not a JSON record", id="a-bad-line-inside"),
    # ------------------------------------------------ the dry run checks what the run checks
    refused(bad_rates_dry_run, "filter.pass_rate_file=", "line 1", id="dry-run-with-a-bad-pass-rate-file"),
    refused(lambda ws, mp: ["dry_run=True", "seed=7"], "holds another run's checkpoints",
            id="dry-run-into-a-runs-folder"),
    refused(lambda ws, mp: ["dry_run=True", "resume=auto", "lr=1e-3"], "lr: 5e-05 -> 0.001",
            id="dry-run-resuming-with-another-lr"),
    # ------------------------------------------------ the logger, before the model is built
    refused(no_wandb_login, "logger='wandb': no Weights & Biases login", "`wandb login`", "WANDB_MODE=offline",
            id="wandb-without-a-login"),
    refused(lambda ws, mp: mp.setitem(sys.modules, "wandb", None) or ["logger=wandb"], "pip install wandb",
            id="wandb-not-installed"),
]


def attempt(ws, extra) -> tuple[str | None, list[str]]:
    """train.main on the row's settings, train.run replaced by ws.start_run: (its ConfigError line or None,
    the warnings it gave)."""
    cfg = parse_args(ws.argv(*extra))
    if ws.resume_changed:
        cfg.resume_changed = True  # a TrainConfig field once config.py declares it; until then set on the object
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        try:
            train.main(cfg)
        except ConfigError as e:
            return str(e), [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    return None, [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


@pytest.mark.parametrize("make, kind, want", BREAK)
def test_a_broken_run_folder_ends_in_one_exact_outcome(make, kind, want, ws, monkeypatch, capsys):
    if kind == "raises":
        with pytest.raises(ValueError) as e:
            make(ws, monkeypatch)
        assert "\n" not in str(e.value) and all(n in str(e.value) for n in want), str(e.value)
        assert ws.seen["left"] == ws.seen["want_left"]
        return
    monkeypatch.setattr(train, "run", ws.start_run)
    try:
        error, warned = attempt(ws, make(ws, monkeypatch))
    finally:
        if "stop" in ws.seen:
            ws.seen["stop"].kill()
            ws.seen["stop"].wait()
    out = capsys.readouterr().out
    if kind == "refused":
        assert error is not None, "the run started"
        assert "\n" not in error and all(n in error for n in want), error
        assert not ws.started
        lock = os.path.join(ws.run, "run.lock")
        if os.path.exists(lock):  # the row's own
            with open(lock) as f:
                assert json.load(f)["pid"] != os.getpid()
    else:
        assert error is None, error
        want(ws, out, warned)


def test_the_resumable_settings_are_config_fields():
    """checkpoint.RESUMABLE names settings a config has (resume_changed: once config.py declares it)."""
    config = checkpoint.config_dict(TrainConfig())
    names = {*config, *(f"{k}.{f}" for k, v in config.items() if isinstance(v, dict) for f in v)}
    assert set(checkpoint.RESUMABLE) - {"resume_changed"} <= names


def test_settings_that_may_change_on_resume_leave_it_the_same_run(ws, monkeypatch, capsys):
    """More RL steps, other evals, checkpoints, logger and batching: resume=auto continues, saying nothing."""
    monkeypatch.setattr(train, "run", ws.start_run)
    error, warned = attempt(ws, ["resume=auto", "rl_steps=5", "eval_every=1", "ckpt_every=2", "ckpt_keep=3",
                                 "logger=tensorboard", "microbatch_tokens=1024", "gen_batch_rows=16"])
    assert error is None and not warned
    (_, start), = ws.started
    assert start.ckpt == os.path.join(ws.run, NEWEST) and start.resumed["stage"] == "rl"
    assert "resume_changed" not in capsys.readouterr().out
    assert torch.load(os.path.join(start.ckpt, "trainer_state.pt"), weights_only=False)["step"] == 0


@pytest.mark.parametrize("error", [OSError(errno.EACCES, "Permission denied"), OSError(errno.ENOSPC, "No space left"),
                                   SafetensorError("Permission denied (os error 13)")], ids=["eacces", "enospc", "safetensors"])
def test_the_final_model_save_that_cannot_write_is_one_write_error(error, monkeypatch, tmp_path):
    """out_dir made read-only (or full) during the run: the final save_hf is a WriteError line, not a traceback."""
    def fail(*args, **kwargs):
        raise error
    monkeypatch.setattr(checkpoint, "save_hf", fail)
    cfg = micro_config(tmp_path)
    with pytest.raises(WriteError, match=f"cannot write (the model in )?{cfg.out_dir}") as e:
        checkpoint.save_model(None, None, cfg, 0)
    assert "\n" not in str(e.value)


def full_disk_writes(mp, root):
    """safetensors' writes under `root` fail as a full disk fails them: part of the file lands, then ENOSPC."""
    import safetensors.torch
    save_file = safetensors.torch.save_file

    def write(tensors, filename, metadata=None):
        if os.path.abspath(filename).startswith(f"{root}{os.sep}"):
            with open(filename, "wb") as f:
                f.write(b"\0" * 100)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)
        return save_file(tensors, filename, metadata=metadata)
    mp.setattr(safetensors.torch, "save_file", write)


@pytest.mark.parametrize("sibling_room", [True, False], ids=["beside-out_dir", "beside-full-so-under-TMPDIR"])
def test_a_final_model_out_dir_cannot_take_is_saved_in_a_rescue_folder(sibling_room, monkeypatch, tmp_path):
    """ckpt_every=0 and the disk filled during the run: the final save fails, and the model, which exists only in
    memory, is written to <out_dir>.rescue-<pid> (or, with no room there, the same name under $TMPDIR) whole; the
    WriteError line says where it went."""
    from hf import load_hf
    from tokenizer import load_hf_tokenizer
    disk, scratch = tmp_path / "disk", tmp_path / "scratch"
    disk.mkdir(), scratch.mkdir()
    cfg = micro_config(disk, ["ckpt_every=0"])
    run = make_run(cfg)
    # out_dir full as the write below finds it; with no room beside it either, its whole filesystem full
    fake_disk(monkeypatch, cfg.out_dir if sibling_room else disk, 1000)
    full_disk_writes(monkeypatch, cfg.out_dir)
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    with pytest.raises(WriteError) as e:
        checkpoint.save_model(run.model, run.tok, cfg, param_counts(cfg.model)["total"])
    rescue = os.path.join(disk if sibling_room else scratch, f"run.rescue-{os.getpid()}")
    assert str(e.value) == (f"cannot write {cfg.out_dir}: No space left on device (ENOSPC): 1,000 bytes are free; the "
                            f"trained model is saved in {rescue} instead (config.json, safetensors and tokenizer "
                            f"files, as out_dir would hold them): move them into {cfg.out_dir} once there is room, "
                            f"or load them from there (init_from={rescue!r})")
    saved = load_hf(rescue).state_dict()
    assert all(torch.equal(saved[n], t) for n, t in run.model.state_dict().items())
    assert load_hf_tokenizer(rescue).encode("question 7") == run.tok.encode("question 7")
    assert not [f for f in os.listdir(cfg.out_dir) if f.endswith(".partial")]  # no torn shard left in out_dir
    if not sibling_room:
        assert not os.path.exists(os.path.join(disk, f"run.rescue-{os.getpid()}"))


@pytest.mark.parametrize("with_checkpoint", [False, True], ids=["no-checkpoint", "a-checkpoint"])
def test_a_final_model_no_folder_takes_says_what_failed_and_what_is_left(with_checkpoint, monkeypatch, tmp_path):
    """Every write fails: the line names each failure, says the model is lost, and names the newest checkpoint."""
    cfg = micro_config(tmp_path, ["ckpt_every=0"])
    run = make_run(cfg)
    if with_checkpoint:
        os.makedirs(os.path.join(cfg.out_dir, "ckpt", "step_00000004"))
        open(os.path.join(cfg.out_dir, "ckpt", "step_00000004", checkpoint.COMPLETE_MARKER), "w").close()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "scratch"))
    full_disk_writes(monkeypatch, tmp_path)
    with pytest.raises(WriteError) as e:
        checkpoint.save_model(run.model, run.tok, cfg, param_counts(cfg.model)["total"])
    beside, scratch = (os.path.join(tmp_path, where, f"run.rescue-{os.getpid()}") for where in ("", "scratch"))
    assert str(e.value).startswith(f"cannot write {cfg.out_dir}: No space left on device (ENOSPC): ")
    assert f"; no rescue folder took it either (cannot write {beside}: No space left on device (ENOSPC): " in str(e.value)
    assert f"; cannot write {scratch}: No space left on device (ENOSPC): " in str(e.value)
    assert str(e.value).endswith(
        f"the trained model is lost; the newest checkpoint ({cfg.out_dir}/ckpt/step_00000004) holds the last good "
        f"state (resume=auto continues from it once there is room)" if with_checkpoint else
        "the trained model is lost; no checkpoint was written (ckpt_every=0)")
    assert not os.path.exists(beside) and not os.path.exists(scratch)  # nothing partial left


def test_a_lock_that_cannot_be_removed_is_a_warning_not_an_error(tmp_path, monkeypatch):
    lock = take_lock(str(tmp_path), "run")
    monkeypatch.setattr(os, "remove", lambda path: (_ for _ in ()).throw(PermissionError(errno.EACCES, "denied")))
    with pytest.warns(UserWarning, match="could not remove .*run.lock"):
        lock.release()
