"""No collective waits longer than dist_timeout_s, and a rank that fails ends the job (issue 24, on gloo)."""

import json
import os
import subprocess
import time

import torch
import torch.multiprocessing as mp

from config import load_config
from runs import free_port



def timeouts_worker(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank))
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from distributed import own_meshes, set_group_timeouts, setup_distributed
    cfg = load_config(None, ["ep=2", "dist_timeout_s=123", f"out_dir={out}.run"])
    try:
        setup_distributed(cfg)  # the default group, torchtitan's meshes and their sub-groups
        own_meshes(world, 2)  # the async producer's groups, made later
        set_group_timeouts(cfg.dist_timeout_s)
        seen = []
        for group in c10d._world.pg_map:
            backend = group._get_backend(torch.device("cpu"))
            if getattr(backend, "options", None) is not None:  # gloo; a size-1 mesh dim's fake backend has none
                seen.append(backend.options._timeout.total_seconds())
        if rank == 0:
            with open(out, "w") as f:
                json.dump(seen, f)
    finally:
        dist.destroy_process_group()


def test_every_process_group_of_a_run_times_out_after_dist_timeout_s(tmp_path):
    out = str(tmp_path / "timeouts.json")
    mp.spawn(timeouts_worker, args=(2, free_port(), out), nprocs=2)
    with open(out) as f:
        seen = json.load(f)
    # the world, the mesh dims' and own_meshes' groups; torch's default for groups after the first is 30 minutes
    assert len(seen) >= 4 and set(seen) == {123.0}, seen


# a config file is Python: on rank 1 it makes the optimizer raise at its 6th step (RL, after 3 SFT steps)
RAISES_ON_RANK_1 = """
import os
import torch
if os.environ.get("RANK") == "1":
    _step, _calls = torch.optim.AdamW.step, []

    def _failing_step(self, *args, **kwargs):
        _calls.append(1)
        if len(_calls) == 6:
            raise RuntimeError("injected failure on rank 1")
        return _step(self, *args, **kwargs)
    torch.optim.AdamW.step = _failing_step
"""


def test_a_rank_that_raises_mid_rl_ends_the_job_and_no_rank_hangs(tmp_path):
    from test_distributed_train import ROOT, RUN, torchrun
    cfg_path = tmp_path / "cfg.py"
    cfg_path.write_text(RUN + RAISES_ON_RANK_1)
    timeout_s = 20
    t0 = time.monotonic()
    done = subprocess.run(torchrun(str(cfg_path), f"out_dir={tmp_path / 'run'}", "ep=2", "rl_steps=100",
                                   "eval_every=100", f"dist_timeout_s={timeout_s}"),
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    text = done.stdout + done.stderr
    assert done.returncode != 0 and "injected failure on rank 1" in text, text[-3000:]
    assert "[rank 1] aborting the job: RuntimeError" in text, text[-3000:]
    assert '"stage": "rl"' in (tmp_path / "run" / "metrics.jsonl").read_text()  # it failed inside RL
    assert time.monotonic() - t0 < 240  # the other rank did not wait for ever (torchrun stops it, or its timeout)


def test_save_timeout_grows_with_the_bytes_and_is_never_below_dist_timeout_s():
    from checkpoint import WRITE_BYTES_PER_S, save_timeout_s
    assert save_timeout_s(1_000_000, 600.0) == 600.0  # a small state: dist_timeout_s already suffices
    per_rank = 1.28e12 / 16  # a 100B run's fp32 weights and AdamW state over 16 ranks
    assert save_timeout_s(per_rank, 600.0) > max(600.0, per_rank / WRITE_BYTES_PER_S)  # more than the write itself
    assert save_timeout_s(2 * per_rank, 600.0) > save_timeout_s(per_rank, 600.0)


def slow_save_worker(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank))
    import datetime

    import torch.distributed as dist

    import checkpoint
    from distributed import set_group_timeouts

    def timeout_s(group):
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()

    def slow_write(path, state):  # rank 0's second trainer state takes longer than dist_timeout_s to write
        time.sleep(3 if state["position"] == 2 else 0)
        torch.save(state, path)

    cfg = load_config(None, ["dist_timeout_s=2", f"out_dir={out}.run"])
    checkpoint.WRITE_BYTES_PER_S = 1.0  # so the sizing shows in the timeout beside SAVE_ALLOWANCE_S
    if rank == 0:
        checkpoint._write_trainer_state = slow_write
    # started with a margin for the spawn's skew, then cut to dist_timeout_s as setup_distributed leaves it
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    try:
        set_group_timeouts(cfg.dist_timeout_s)
        model = torch.nn.Linear(4, 4)
        opt = torch.optim.AdamW(model.parameters())
        model(torch.ones(1, 4)).sum().backward()
        opt.step()
        nbytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *opt.state[model.weight].values(),
                                                             *opt.state[model.bias].values()])
        checkpoint.write_checkpoint(cfg.out_dir, 1, model, opt, {"position": 1}, cfg)
        set_group_timeouts(cfg.dist_timeout_s)  # as the async producer does when it makes its groups
        folder = checkpoint.write_checkpoint(cfg.out_dir, 2, model, opt, {"position": 2}, cfg)
        with open(f"{out}.{rank}", "w") as f:
            json.dump(dict(save=timeout_s(checkpoint._save_group[1]), world=timeout_s(dist.group.WORLD),
                           expected=checkpoint.save_timeout_s(nbytes, cfg.dist_timeout_s),
                           complete=os.path.exists(os.path.join(folder, checkpoint.COMPLETE_MARKER))), f)
    finally:
        dist.destroy_process_group()


def test_a_save_slower_than_dist_timeout_s_completes_on_a_group_timed_by_its_bytes(tmp_path):
    out = str(tmp_path / "save")
    mp.spawn(slow_save_worker, args=(2, free_port(), out), nprocs=2)  # raises if a rank's save timed out
    for rank in range(2):
        with open(f"{out}.{rank}") as f:
            seen = json.load(f)
        assert seen["complete"] and seen["world"] == 2.0, seen
        assert seen["save"] == seen["expected"] > 2.0, seen  # sized by the bytes, not dist_timeout_s
