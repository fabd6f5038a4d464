"""Checkpoint and resume: a run killed at a random step, or killed inside a save, and resumed
with resume=auto ends bitwise equal to an uninterrupted run; so does one whose newest checkpoint
was truncated or lost a file (resume=auto falls back past it, warning), and one stopped by a NaN
(its newest checkpoint is the last good state); a crash during a save leaves the previous
checkpoint loadable; a missing or truncated file of any kind makes a checkpoint fail to load,
naming the file; the filter history round-trips."""
import dataclasses
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

import checkpoint
import train
import trainer
from config import load_config
from filter import PromptHistory
from model import Transformer
from trainer import NonFiniteError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A run short enough for a test that still exercises every phase: SFT steps, the eval, RL
# steps that update the policy (RL-ZVP trains even on the all-wrong groups of an untrained
# model), a mid-run eval, and stage-1 filter history with its own RNG.
RUN = """
model = dict(vocab_size=320, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, num_experts=4, top_k=2,
             moe_inter_dim=32, max_seq_len=64)
bpe_merges = 40
train_size = 300
eval_size = 8
eval_samples = 2
sft_steps = 3
sft_batch_size = 8
rl_steps = 4
prompts_per_step = 4
group_size = 4
sampling = dict(max_new_tokens=8, temperature=1.5)
eval_every = 3
filter = dict(zero_variance="rl-zvp", skip_prob=0.5)
lr = 1e-3
"""
TOTAL_STEPS = 3 + 4  # sft_steps + rl_steps: checkpoint positions 1..7


def config(tmp_path, out, *overrides):
    path = tmp_path / "cfg.py"
    path.write_text(RUN)
    return str(path), [f"out_dir={out}", *overrides]


def weights(out):
    return load_file(os.path.join(out, "model.safetensors"))


def records(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items()
                 if (not k.startswith("t") or k == "trained_sequences")}
                for line in f]  # drop timings


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    path, over = config(tmp, tmp / "run", "ckpt_every=0")
    train.main(load_config(path, over))
    return weights(tmp / "run"), records(tmp / "run")


def assert_same_run(out, uninterrupted):
    want_w, want_rec = uninterrupted
    got = weights(out)
    assert got.keys() == want_w.keys()
    for name, t in want_w.items():
        assert torch.equal(got[name], t), name
    assert records(out) == want_rec  # losses, rewards, filter counts and evals, step by step


@pytest.mark.slow  # the kill inside a save (below) covers kill -9 in the default run
def test_killed_run_resumed_with_auto_ends_bitwise_equal_to_uninterrupted(tmp_path, uninterrupted):
    kill_at = random.Random().randrange(1, TOTAL_STEPS)  # the checkpoint after which the run is killed
    out = tmp_path / "run"
    path, over = config(tmp_path, out, "ckpt_every=1", "ckpt_keep=2")
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), path, *over]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    marker = out / "ckpt" / f"step_{kill_at:08d}" / checkpoint.COMPLETE_MARKER
    deadline = time.monotonic() + 120
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)  # somewhere in the step after kill_at, or in its checkpoint
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, f"the run ended before checkpoint {kill_at}: {proc.stderr.read()[-2000:]}"
    assert checkpoint.latest_checkpoint(str(out)) is not None
    done = subprocess.run(cmd + ["resume=auto"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming from" in done.stdout
    assert_same_run(out, uninterrupted)


def test_crash_during_a_checkpoint_save_leaves_the_previous_one_loadable(tmp_path, monkeypatch, uninterrupted):
    out = tmp_path / "run"
    path, over = config(tmp_path, out, "ckpt_every=2")
    calls = []
    real = checkpoint._write_trainer_state

    def crash_on_second_save(p, state):  # the model and optimizer shards are already written by now
        calls.append(p)
        if len(calls) == 2:
            raise OSError("disk full (injected)")
        real(p, state)

    monkeypatch.setattr(checkpoint, "_write_trainer_state", crash_on_second_save)
    with pytest.raises(OSError, match="injected"):
        train.main(load_config(path, over))
    ckpt_dir = out / "ckpt"
    assert sorted(os.listdir(ckpt_dir)) == ["step_00000002", "step_00000004.tmp"]
    assert not (ckpt_dir / "step_00000004.tmp" / checkpoint.COMPLETE_MARKER).exists()
    assert checkpoint.latest_checkpoint(str(out)) == str(ckpt_dir / "step_00000002")
    saved = json.loads((ckpt_dir / "step_00000002" / "config.json").read_text())  # the resolved config beside it
    assert saved["ckpt_every"] == 2 and saved["model"]["dim"] == 32
    cfg = load_config(path, over)
    model = Transformer(cfg.model)
    state = checkpoint.read_checkpoint(str(ckpt_dir / "step_00000002"), model, train.sft_optimizer(model, cfg))
    assert (state["stage"], state["step"], state["used"]) == ("sft", 1, 2 * cfg.sft_batch_size)
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        checkpoint.read_checkpoint(str(ckpt_dir / "step_00000004.tmp"), model, train.sft_optimizer(model, cfg))
    monkeypatch.setattr(checkpoint, "_write_trainer_state", real)
    train.main(load_config(path, over + ["resume=auto"]))  # the crashed save is redone, the run finishes
    assert_same_run(out, uninterrupted)
    assert sorted(os.listdir(ckpt_dir)) == ["step_00000004", "step_00000006"]  # ckpt_keep=2, no temporaries left


def test_prompt_history_round_trips_through_its_state_dict():
    h = PromptHistory()
    h.observe("a", 1.0, step=3)
    h.observe(("b", 2), 0.25, step=5)
    g = PromptHistory()
    g.load_state_dict(h.state_dict())
    assert g.records == h.records and list(g.records) == list(h.records)


def test_resume_with_a_kl_reference_model_ends_bitwise_equal(tmp_path):
    """The KL penalty's frozen reference travels in the checkpoint (full tensors) and comes back."""
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    path, over = config(tmp_path, full, "ckpt_every=1", "ckpt_keep=20", "loss.kl_coef=0.1")
    train.main(load_config(path, over))
    shutil.copytree(full, resumed)
    for d in (resumed / "ckpt").iterdir():
        if int(d.name.split("_")[1]) > 5:  # keep up to RL step 1 (3 SFT steps, then 2 RL steps)
            shutil.rmtree(d)
    train.main(load_config(path, [f"out_dir={resumed}", "ckpt_every=1", "ckpt_keep=20", "loss.kl_coef=0.1",
                                        "resume=auto"]))
    a, b = weights(full), weights(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(r.get("loss/kl_ref", 0) > 0 for r in records(resumed))


# ----------------------------------------------------------------------------- checkpoints that fail to load

SHARD = "__0_0.distcp"  # the one shard file a 1-process save writes
CHECKPOINT_FILES = [".metadata", SHARD, "trainer_state.pt", "config.json"]  # every file resuming reads


def damage(folder, name, how):
    """Truncate a checkpoint's file to half its bytes, or delete it."""
    path = os.path.join(folder, name)
    if how == "delete":
        os.remove(path)
    else:
        os.truncate(path, os.path.getsize(path) // 2)


def saved_checkpoints(tmp_path, positions, keep=20):
    """A micro model's checkpoints at `positions` under tmp_path/run (an optimizer step apart: no
    training, only what loads matters); returns the config they were written with."""
    path, over = config(tmp_path, tmp_path / "run", f"ckpt_keep={keep}")
    cfg = load_config(path, over)
    model = Transformer(cfg.model)
    opt = train.sft_optimizer(model, cfg)
    for position in positions:
        sum(p.sum() for p in model.parameters()).backward()
        opt.step()  # the optimizer has state to save
        checkpoint.write_checkpoint(cfg.out_dir, position, model, opt, {"position": position}, cfg)
    return cfg


def folder(cfg, position):
    return os.path.join(cfg.out_dir, checkpoint.CKPT_SUBDIR, f"step_{position:08d}")


@pytest.mark.parametrize("how", ["truncate", "delete"])
@pytest.mark.parametrize("name", CHECKPOINT_FILES)
def test_a_missing_or_truncated_file_makes_a_checkpoint_fail_to_load_naming_the_file(tmp_path, name, how):
    cfg = saved_checkpoints(tmp_path, [1])
    assert checkpoint.load_trainer_state(folder(cfg, 1)) == {"position": 1}
    damage(folder(cfg, 1), name, how)
    with pytest.raises(ValueError, match=f"{folder(cfg, 1)} does not load: {name}"):
        checkpoint.load_trainer_state(folder(cfg, 1))


def test_resume_auto_skips_newer_checkpoints_that_fail_to_load_and_warns_naming_each(tmp_path):
    cfg = saved_checkpoints(tmp_path, [1, 2, 3])
    damage(folder(cfg, 3), SHARD, "truncate")
    damage(folder(cfg, 2), "trainer_state.pt", "delete")
    cfg.resume = "auto"
    with pytest.warns(UserWarning) as caught:
        path, state = checkpoint.resume_checkpoint(cfg)
    assert (path, state) == (folder(cfg, 1), {"position": 1})
    assert [str(w.message).split(" does not load")[0] for w in caught] == [
        f"checkpoint {folder(cfg, 3)}", f"checkpoint {folder(cfg, 2)}"]  # newest first, each named


def test_resume_auto_with_no_checkpoint_that_loads_is_an_error_and_with_none_at_all_starts_afresh(tmp_path):
    cfg = saved_checkpoints(tmp_path, [1, 2])
    for position in (1, 2):
        damage(folder(cfg, position), ".metadata", "delete")
    cfg.resume = "auto"
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="none of the 2 complete checkpoints"):
        checkpoint.resume_checkpoint(cfg)
    cfg.resume = folder(cfg, 2)  # a folder named outright is not skipped: its failure is the error
    with pytest.raises(ValueError, match="does not load: .metadata"):
        checkpoint.resume_checkpoint(cfg)
    cfg.out_dir, cfg.resume = str(tmp_path / "fresh"), "auto"
    assert checkpoint.resume_checkpoint(cfg) == (None, None)


def test_pruning_keeps_ckpt_keep_loadable_checkpoints_beside_a_later_one_that_fails_to_load(tmp_path):
    """A checkpoint at a later position than the one just written (left by an earlier attempt, which
    this run redoes; here one that no longer loads) does not count toward ckpt_keep, so it never pushes
    out a loadable one; the run replaces it when it reaches its position."""
    cfg = saved_checkpoints(tmp_path, [9], keep=2)
    damage(folder(cfg, 9), SHARD, "truncate")
    saved_checkpoints(tmp_path, [1, 2, 3], keep=2)
    assert sorted(os.listdir(os.path.join(cfg.out_dir, "ckpt"))) == ["step_00000002", "step_00000003", "step_00000009"]
    cfg.resume = "auto"
    with pytest.warns(UserWarning, match="step_00000009"):
        assert checkpoint.resume_checkpoint(cfg)[0] == folder(cfg, 3)


class Stop(Exception):
    """Ends a test run right after a checkpoint, as a crash there would."""


def stop_after_checkpoint(monkeypatch, position):
    real = train.write_checkpoint

    def write_then_stop(out_dir, pos, *args):
        path = real(out_dir, pos, *args)
        if pos == position:
            raise Stop(path)
        return path

    monkeypatch.setattr(train, "write_checkpoint", write_then_stop)


@pytest.mark.parametrize("name,how", [(SHARD, "truncate"), ("trainer_state.pt", "delete")])
def test_resume_auto_past_a_newest_checkpoint_that_fails_to_load_ends_bitwise_equal(tmp_path, monkeypatch,
                                                                                    uninterrupted, name, how):
    out = tmp_path / "run"
    path, over = config(tmp_path, out, "ckpt_every=1", "ckpt_keep=2")
    stop_after_checkpoint(monkeypatch, 5)  # after RL step 1 (3 SFT steps, then 2 RL steps)
    with pytest.raises(Stop):
        train.main(load_config(path, over))
    newest = out / "ckpt" / "step_00000005"
    assert checkpoint.latest_checkpoint(str(out)) == str(newest)
    damage(newest, name, how)
    monkeypatch.undo()
    with pytest.warns(UserWarning, match=re.escape(f"{newest} does not load: {name}")):
        train.main(load_config(path, over + ["resume=auto"]))  # from step_00000004
    assert_same_run(out, uninterrupted)
    assert sorted(os.listdir(out / "ckpt")) == ["step_00000006", "step_00000007"]  # the damaged one was replaced


# The training script with its trainer-state write hanging inside the save at position HANG_AT, after
# every model and optimizer shard is written: a kill then lands mid-save, not by luck of timing.
HANG_IN_SAVE = """
import os, runpy, sys, time
sys.path.insert(0, {root!r})
import checkpoint
real = checkpoint._write_trainer_state
def hang(path, state):
    if os.path.basename(os.path.dirname(path)) == "step_%08d.tmp" % int(os.environ["HANG_AT"]):
        open(os.environ["HANG_FLAG"], "w").close()
        time.sleep(600)
    real(path, state)
checkpoint._write_trainer_state = hang
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_run_killed_inside_a_checkpoint_save_resumes_with_auto_and_ends_bitwise_equal(tmp_path, uninterrupted):
    out, flag = tmp_path / "run", tmp_path / "in_save"
    path, over = config(tmp_path, out, "ckpt_every=1", "ckpt_keep=2")
    script = [os.path.join(ROOT, "train.py"), path, *over]
    env = {**os.environ, "HANG_AT": "5", "HANG_FLAG": str(flag)}
    proc = subprocess.Popen([sys.executable, "-c", HANG_IN_SAVE.format(root=ROOT), *script], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not flag.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert flag.exists(), f"the run never reached the save at position 5: {proc.stderr.read()[-2000:]}"
    tmp_folder = out / "ckpt" / "step_00000005.tmp"
    assert SHARD in os.listdir(tmp_folder) and checkpoint.COMPLETE_MARKER not in os.listdir(tmp_folder)
    assert checkpoint.latest_checkpoint(str(out)) == str(out / "ckpt" / "step_00000004")
    done = subprocess.run([sys.executable, *script, "resume=auto"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming from" in done.stdout and "step_00000004" in done.stdout
    assert_same_run(out, uninterrupted)
    assert sorted(os.listdir(out / "ckpt")) == ["step_00000006", "step_00000007"]  # the half save is gone


def test_run_stopped_by_a_nan_keeps_its_last_good_checkpoint_newest_and_resumes_bitwise_equal(tmp_path, monkeypatch,
                                                                                            uninterrupted):
    """The known defect's NaN (logits / temperature 0 in the trainer's forward, here from RL step 1 on)
    stops the run before that step's optimizer step: nothing is written after it, the newest checkpoint
    holds finite weights, and resuming from it once the cause is gone ends as if nothing had happened."""
    out = tmp_path / "run"
    path, over = config(tmp_path, out, "ckpt_every=1", "ckpt_keep=2")
    real = trainer.policy_logprobs
    step = {}

    def at_temperature_zero_from_rl_step_1(model, batch, idx, cfg):
        if step.get("rl", 0) >= 1:  # SamplingParams allows 0 (greedy); only a run's config refuses it (RELATIONS)
            cfg = dataclasses.replace(cfg, sampling=dataclasses.replace(cfg.sampling, temperature=0.0))
        return real(model, batch, idx, cfg)

    def note_step(model, opt, batch, rl_step, cfg, ref_model=None):
        step["rl"] = rl_step
        return trainer.train_on_rollouts(model, opt, batch, rl_step, cfg, ref_model)

    monkeypatch.setattr(trainer, "policy_logprobs", at_temperature_zero_from_rl_step_1)
    monkeypatch.setattr(train, "train_on_rollouts", note_step)
    with pytest.raises(NonFiniteError) as stop:
        train.main(load_config(path, over))
    assert (stop.value.stage, stop.value.step) == ("rl", 1)
    assert "at rl step 1" in str(stop.value)
    newest = checkpoint.latest_checkpoint(str(out))
    assert newest == str(out / "ckpt" / "step_00000004")  # after RL step 0; no later one, not even a temporary
    assert sorted(os.listdir(out / "ckpt")) == ["step_00000003", "step_00000004"]
    assert not (out / "model.safetensors").exists()  # no final model of the stopped run
    cfg = load_config(path, over)
    model = Transformer(cfg.model)
    checkpoint.read_checkpoint(newest, model, train.rl_optimizer(model, cfg))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    monkeypatch.undo()
    train.main(load_config(path, over + ["resume=auto"]))
    assert_same_run(out, uninterrupted)
