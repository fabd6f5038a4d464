"""Checkpoints: resumable state with torch.distributed.checkpoint, and the final safetensors model.

write_checkpoint saves model and optimizer (each rank its shards) plus the replicated
trainer state (RNG states, data position, filter history, length predictor, evals) to
out_dir/ckpt/step_<position>/, atomically: all goes to a `.tmp` folder, a completeness
marker last, then a rename, so a crash mid-save leaves the previous checkpoint as it was.
read_checkpoint loads one written by any number of ranks; `resume=auto` (resume_path)
picks the newest complete one, and a resumed run ends bit-exactly where an uninterrupted
one would.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import warnings
from typing import TYPE_CHECKING

import torch

from distributed import full_policy_tensors, rank_world
from hf import umask_mode

if TYPE_CHECKING:
    from config import TrainConfig


CKPT_SUBDIR = "ckpt"  # under out_dir: one folder per checkpoint, step_<position>
COMPLETE_MARKER = "COMPLETE"  # written last inside the temporary folder: its presence means every file is there
DCP_SINGLE_PROCESS_WARNING = "torch.distributed is disabled"  # DCP's note that one process saves alone: expected here


def _barrier():
    if rank_world()[1] > 1:
        import torch.distributed as dist
        dist.barrier()


def _fsync_dir(path: str):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_trainer_state(path: str, state: dict):
    torch.save(state, path)


def latest_checkpoint(out_dir: str) -> str | None:
    """The newest complete checkpoint folder under out_dir/ckpt (by position), or None.

    Temporary folders (a save that crashed) and folders without the marker are ignored.
    """
    root = os.path.join(out_dir, CKPT_SUBDIR)
    if not os.path.isdir(root):
        return None
    names = sorted(n for n in os.listdir(root) if n.startswith("step_") and not n.endswith(".tmp")
                   and os.path.exists(os.path.join(root, n, COMPLETE_MARKER)))
    return os.path.join(root, names[-1]) if names else None


def write_checkpoint(out_dir: str, position: int, model, opt, trainer_state: dict, cfg: TrainConfig) -> str:
    """Save model and optimizer (torch.distributed.checkpoint, each rank its shards) and the
    replicated trainer state (RNGs, data position, filter history, length predictor; rank 0)
    to out_dir/ckpt/step_<position>, atomically: all is written to a `.tmp` folder, the
    completeness marker last, then the folder is renamed. A crash at any point leaves the
    previous checkpoints as they were. Keeps the newest cfg.ckpt_keep. Collective.
    Returns the checkpoint folder.
    """
    import shutil

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    rank, _ = rank_world()
    root = os.path.join(out_dir, CKPT_SUBDIR)
    final = os.path.join(root, f"step_{position:08d}")
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that crashed
        os.makedirs(tmp)
    _barrier()
    model_sd, optim_sd = get_state_dict(model, opt)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=DCP_SINGLE_PROCESS_WARNING)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp)
    if rank == 0:
        _write_trainer_state(os.path.join(tmp, "trainer_state.pt"), trainer_state)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            f.write(json.dumps(dataclasses.asdict(cfg), default=str, indent=1))
    _barrier()
    if rank == 0:
        with open(os.path.join(tmp, COMPLETE_MARKER), "w") as f:
            f.write(f"{position}\n")
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        if os.path.exists(final):  # a run resumed from an older checkpoint passes this position again
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(root)
        done = sorted(n for n in os.listdir(root) if n.startswith("step_") and not n.endswith(".tmp"))
        for name in done[:-cfg.ckpt_keep] if cfg.ckpt_keep > 0 else []:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    _barrier()
    return final


def read_checkpoint(path: str, model, opt) -> dict:
    """Load model and optimizer from a write_checkpoint folder (in place; any world size's
    shards) and return its trainer state. Raises ValueError if the folder is not complete."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    if not os.path.exists(os.path.join(path, COMPLETE_MARKER)):
        raise ValueError(f"{path} is not a complete checkpoint (no {COMPLETE_MARKER} marker)")
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=DCP_SINGLE_PROCESS_WARNING)
        dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return torch.load(os.path.join(path, "trainer_state.pt"), weights_only=False)


def rng_state() -> dict:
    """torch (CPU and CUDA) and python `random` generator states."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict):
    """Restore what rng_state() returned."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def resume_path(cfg: TrainConfig) -> str | None:
    """The checkpoint to resume from: cfg.resume "" (none), "auto" (newest complete in out_dir, if any) or a folder."""
    if not cfg.resume:
        return None
    if cfg.resume == "auto":
        return latest_checkpoint(cfg.out_dir)
    if not os.path.exists(os.path.join(cfg.resume, COMPLETE_MARKER)):
        raise ValueError(f"resume={cfg.resume!r}: not a complete checkpoint folder (valid: '', 'auto', or a folder "
                         f"under {os.path.join(cfg.out_dir, CKPT_SUBDIR)} holding {COMPLETE_MARKER})")
    return cfg.resume


def save_checkpoint(model, cfg: TrainConfig, out_dir: str):
    """model.safetensors (config JSON in its metadata) and config.json, written atomically.

    Multi-rank: every rank gathers the full tensors (a collective), rank 0 writes.
    """
    from safetensors.torch import save_file, save_model
    cfg_json = json.dumps(dataclasses.asdict(cfg), default=str, indent=1)
    tmp = os.path.join(out_dir, "model.safetensors.tmp")
    rank, world = rank_world()
    if world > 1:
        tensors = {n: t.contiguous() for n, t in full_policy_tensors(model)}
        if rank == 0:
            save_file(tensors, tmp, metadata={"config": cfg_json})
    else:
        save_model(model, tmp, metadata={"config": cfg_json})
    if rank == 0:
        umask_mode(tmp)
        os.replace(tmp, os.path.join(out_dir, "model.safetensors"))
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            f.write(cfg_json)
