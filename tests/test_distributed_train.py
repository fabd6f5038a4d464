"""train.py under `torchrun --nproc_per_node=2` on CPU (gloo): FSDP=2 x EP=2 equals the 1-process
run step by step, and a rank that dies ends the job with a readable message instead of a hang."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file

import checkpoint
import distributed
import train
from config import load_config
from hf import save_hf
from model import Transformer
from plan import engine_bytes
from weights import full_tensor, policy_tensors

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# gen_batch_rows = 8 gives two generation batches per round (2 prompts x G = 4 each), one per
# rank; the 2-rank run generates each with the prompts and seed the 1-process run does, so
# both train on the same rollouts. RL-ZVP makes the all-wrong groups of an untrained model
# train too; init_std = 0.3 makes the model's token entropies differ (near-uniform outputs
# give RL-ZVP advantages of about 1e-4, differences of nearly equal entropies), so the RL
# losses are about 0.1 and the comparison is not of rounding noise.
RUN = """
model = dict(vocab_size=320, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, num_experts=4, top_k=2,
             moe_inter_dim=32, max_seq_len=64, init_std=0.3)
bpe_merges = 40
train_size = 300
eval_size = 8
eval_samples = 2
sft_steps = 3
sft_batch_size = 8
rl_steps = 3
prompts_per_step = 4
group_size = 4
sampling = dict(max_new_tokens=8, temperature=1.5)
gen_batch_rows = 8
eval_every = 2
filter = dict(zero_variance="rl-zvp", zvp_alpha=1.0)
lr = 1e-3
ckpt_every = 0
"""
TOL = 1e-5


def torchrun(*args):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            os.path.join(ROOT, "train.py"), *args]


def records(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


# each torchrun case costs 20-40 s on 2 cores: the KL variant, the sync resume and the seeded start are `slow`
@pytest.mark.parametrize("extra", [[], pytest.param(["loss.kl_coef=0.5"], marks=pytest.mark.slow)],
                         ids=["plain", "kl-to-sharded-reference"])
def test_two_ranks_with_ep2_match_the_one_process_run_step_by_step(tmp_path, extra):
    cfg_path = tmp_path / "cfg.py"
    cfg_path.write_text(RUN)
    one, two = tmp_path / "one", tmp_path / "two"
    train.main(load_config(str(cfg_path), [f"out_dir={one}", *extra]))
    done = subprocess.run(torchrun(str(cfg_path), f"out_dir={two}", "ep=2", *extra), cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    want, got = records(one), records(two)
    assert [(r["stage"], r["step"]) for r in got] == [(r["stage"], r["step"]) for r in want]
    for w, g in zip(want, got):
        where = f"{w['stage']} step {w['step']}"
        if w["stage"] == "sft":
            assert abs(g["loss"] - w["loss"]) <= TOL, where
        elif w["stage"] == "rl":  # the same rollouts, rewards and filter decisions; losses equal to float rounding
            for k in ("reward", "completion_len", "stop_frac", "trained_sequences", "filter/groups",
                      "filter/zvp_sequences", "filter/tokens_generated"):
                assert g[k] == w[k], (where, k)
            for k in ("loss", "grad_norm", "mismatch/kl"):  # with kl_coef, the loss includes the KL term
                assert abs(g[k] - w[k]) <= TOL, (where, k, g[k], w[k])
        else:
            assert (g["eval_acc"], g["eval_greedy_acc"]) == (w["eval_acc"], w["eval_greedy_acc"]), where
    assert any(abs(r["loss"]) > 1e-2 for r in want if r["stage"] == "rl")  # the RL comparison is not of zeros
    if extra:  # the policy moved away from its reference after the first update (the metric is a mean of
        # per-micro-batch means, so it depends on the split; the loss above is what must match)
        for recs in (want, got):
            assert any(r["loss/kl_ref"] > 1e-6 for r in recs if r["stage"] == "rl")
    a, b = load_file(one / "model.safetensors"), load_file(two / "model.safetensors")
    assert a.keys() == b.keys()  # the 2-rank run writes full tensors under the 1-process names
    # the engine bytes each rank reports: the plan's, and no replica (half the experts, the 1-process engine's all)
    plan = engine_bytes(load_config(str(cfg_path), ["ep=2", *extra]), 2)
    for r in (r for r in got if r["stage"] == "rl"):
        assert (r["engine/dense_bytes"], r["engine/experts_bytes"]) == (plan["dense"], plan["experts"])
        assert 0 < r["engine/kv_cache_bytes"] <= plan["kv_cache"]
        assert 2 * r["engine/experts_bytes"] == next(w for w in want if w["stage"] == "rl")["engine/experts_bytes"]


def children(pid: int) -> list[int]:
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out


def rank_of(pid: int) -> int | None:
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    return int(env[b"RANK"]) if b"RANK" in env else None


TORCHRUN_GRACE_S = 30  # torchrun's wait between SIGTERM and SIGKILL when it stops the workers left


@pytest.mark.parametrize("how", [signal.SIGKILL, pytest.param(signal.SIGSTOP, marks=pytest.mark.slow)],
                         ids=["killed", "frozen"])
def test_a_dead_rank_ends_the_job_with_a_message_within_the_timeout(tmp_path, how):
    """SIGKILL: torchrun sees the worker die and stops the job at once. SIGSTOP (a hung rank):
    the other rank's next collective fails after dist_timeout_s, it exits naming the cause,
    and torchrun then stops the frozen one (SIGTERM, then SIGKILL after its grace period)."""
    cfg_path = tmp_path / "cfg.py"
    cfg_path.write_text(RUN)
    timeout_s = 20
    out, log = tmp_path / "run", open(tmp_path / "log.txt", "w+")
    proc = subprocess.Popen(torchrun(str(cfg_path), f"out_dir={out}", "ep=2", "rl_steps=1000", "eval_every=1000",
                                     f"dist_timeout_s={timeout_s}"),
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True)
    victim = None
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:  # wait until RL steps are running
            if (out / "metrics.jsonl").exists() and '"stage": "rl"' in (out / "metrics.jsonl").read_text():
                break
            time.sleep(0.2)
        assert proc.poll() is None, (tmp_path / "log.txt").read_text()[-3000:]
        victim = next(c for c in children(proc.pid) if rank_of(c) == 1)
        os.kill(victim, how)
        t0 = time.monotonic()
        proc.wait(timeout=timeout_s + 60)
        elapsed = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if victim is not None:
            try:
                os.kill(victim, signal.SIGKILL)
            except ProcessLookupError:
                pass
    text = (tmp_path / "log.txt").read_text()
    assert proc.returncode != 0
    assert elapsed <= timeout_s + TORCHRUN_GRACE_S + 20, elapsed
    assert "ChildFailedError" in text or "aborting the job" in text, text[-3000:]
    if how == signal.SIGSTOP:
        assert "aborting the job" in text and f"dist_timeout_s={timeout_s}" in text, text[-3000:]


@pytest.mark.slow
def test_two_rank_run_resumed_from_its_checkpoint_ends_bitwise_equal(tmp_path):
    import shutil
    cfg_path = tmp_path / "cfg.py"
    cfg_path.write_text(RUN)
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    done = subprocess.run(torchrun(str(cfg_path), f"out_dir={first}", "ep=2", "ckpt_every=4", "ckpt_keep=1"),
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    ckpt = checkpoint.latest_checkpoint(str(first))
    assert ckpt.endswith("step_00000004")  # after RL step 0: SFT's 3 steps, then one RL step
    shutil.copytree(ckpt, resumed / "ckpt" / os.path.basename(ckpt))
    shutil.copy(first / "metrics.jsonl", resumed / "metrics.jsonl")
    done = subprocess.run(torchrun(str(cfg_path), f"out_dir={resumed}", "ep=2", "resume=auto"),
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    a, b = load_file(first / "model.safetensors"), load_file(resumed / "model.safetensors")
    for name, t in a.items():
        assert torch.equal(b[name], t), name


def test_two_rank_async_run_checkpoints_and_resumes_within_its_staleness_bound(tmp_path):
    """max_staleness=1 under torchrun: the producer decodes on a sharded copy of the policy over its
    own process groups; a checkpoint after RL step 0 resumes into steps 1..3, rollouts never older
    than one version (async resumes validly, not bitwise: which version a step gets is timing)."""
    import shutil
    cfg_path = tmp_path / "cfg.py"
    cfg_path.write_text(RUN)
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    args = ["ep=2", "max_staleness=1", "rl_steps=4", "ckpt_every=4", "ckpt_keep=1"]
    done = subprocess.run(torchrun(str(cfg_path), f"out_dir={first}", *args), cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    ckpt = checkpoint.latest_checkpoint(str(first))
    assert ckpt.endswith("step_00000004")  # after RL step 0: SFT's 3 steps, then one RL step
    shutil.copytree(ckpt, resumed / "ckpt" / os.path.basename(ckpt))
    shutil.copy(first / "metrics.jsonl", resumed / "metrics.jsonl")
    done = subprocess.run(torchrun(str(cfg_path), f"out_dir={resumed}", *args, "resume=auto"), cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    for out in (first, resumed):
        rl = [r for r in records(out) if r["stage"] == "rl"]
        assert [r["step"] for r in rl] == [0, 1, 2, 3]
        assert all(r["async/staleness_max"] <= 1 for r in rl if "async/staleness_max" in r)
        assert all(r["trained_sequences"] == 16 for r in rl)  # 4 prompts x G = 4, RL-ZVP keeps every group
    assert load_file(resumed / "model.safetensors").keys() == load_file(first / "model.safetensors").keys()


def build_worker(rank, world, port, cfg, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        meshes = distributed.build_meshes(world, cfg.ep)
        torch.manual_seed(cfg.seed)
        full = {n: full_tensor(t) for n, t in policy_tensors(distributed.build_model(cfg, meshes))}
        if rank == 0:
            torch.save(full, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("init", [pytest.param("seed", marks=pytest.mark.slow), "hf"])
def test_two_rank_model_starts_from_the_one_process_weights(tmp_path, init):
    """Random init: every rank builds the 1-process model under the seed and keeps its slice.
    HF: built on meta, sharded, then each rank reads its slice of the checkpoint (load_hf)."""
    import socket
    # vocab_size: the byte-level demo tokenizer's 259 ids fit (bpe_merges=0), a relation load_config checks
    overrides = ["ep=2", "model.num_experts=4", "model.dim=32", "model.n_layers=2", "model.n_heads=4",
                 "model.n_kv_heads=2", "model.head_dim=8", "model.moe_inter_dim=16", "model.vocab_size=320",
                 "bpe_merges=0", "model.qk_norm=true"]
    cfg = load_config(None, overrides)
    torch.manual_seed(cfg.seed)
    if init == "hf":
        torch.manual_seed(123)
        saved = Transformer(cfg.model)  # weights the run's own seed would not give
        save_hf(saved, str(tmp_path / "hf"))
        # lengths that fit the model's 1024 positions (CHECKPOINT_DEFAULTS' 1024 + 4096 do not)
        cfg = load_config(None, overrides + [f"init_hf={tmp_path / 'hf'}", "sampling.max_new_tokens=64",
                                             "max_prompt_tokens=0"])
        torch.manual_seed(cfg.seed)
    want = dict(distributed.build_model(cfg).named_parameters())
    if init == "hf":
        assert all(torch.equal(want[n], p) for n, p in saved.named_parameters())
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.start_processes(build_worker, args=(2, port, cfg, str(tmp_path / "full.pt")), nprocs=2, join=True,
                       start_method="spawn")
    got = torch.load(tmp_path / "full.pt")
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert torch.equal(got[name], t.detach()), name
