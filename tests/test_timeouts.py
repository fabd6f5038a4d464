"""No collective waits longer than dist_timeout_s, and a rank that fails ends the job (issue 24, on gloo)."""

import json
import os
import socket
import subprocess
import time

import torch
import torch.multiprocessing as mp

from config import load_config


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
