"""Checkpoint and resume: a run killed at a random step and resumed with resume=auto ends
bitwise equal to an uninterrupted run; a crash during a save leaves the previous checkpoint
loadable; the filter history round-trips."""
import json
import os
import random
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
from config import load_config
from filter import PromptHistory
from model import Transformer

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
max_new_tokens = 8
temperature = 1.5
eval_every = 3
zero_variance = "rl-zvp"
skip_prob = 0.5
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
        return [{k: v for k, v in json.loads(line).items() if not k.startswith("t") or k == "trained_sequences"}
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
    assert (state["phase"], state["step"], state["used"]) == ("sft", 1, 2 * cfg.sft_batch_size)
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
    path, over = config(tmp_path, full, "ckpt_every=1", "ckpt_keep=20", "kl_coef=0.1")
    train.main(load_config(path, over))
    shutil.copytree(full, resumed)
    for d in (resumed / "ckpt").iterdir():
        if int(d.name.split("_")[1]) > 5:  # keep up to RL step 1 (3 SFT steps, then 2 RL steps)
            shutil.rmtree(d)
    train.main(load_config(path, [f"out_dir={resumed}", "ckpt_every=1", "ckpt_keep=20", "kl_coef=0.1",
                                        "resume=auto"]))
    a, b = weights(full), weights(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(r.get("loss/kl_ref", 0) > 0 for r in records(resumed))
