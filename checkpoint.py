"""Checkpoints: resumable state with torch.distributed.checkpoint.

This file owns everything a run writes to resume from (the final model is hf.save_hf's, in the
hub layout):
- write_checkpoint saves model and optimizer (each rank its shards) plus the replicated
  trainer state (RNG states, data position, filter history, length predictor, evals) to
  out_dir/ckpt/step_<position>/, atomically, and keeps the newest cfg.ckpt_keep;
- read_checkpoint loads one written by any number of ranks into a model and optimizer;
- resume_path / latest_checkpoint pick the folder `resume=` names (`auto`: the newest
  complete one); rng_state / set_rng_state carry the generators across.
A resumed run ends bit-exactly where an uninterrupted one would (train.py restores the RNGs
last, so nothing draws between the restore and the next step).

Notable choices:
1. Atomic saves: all goes to `step_<position>.tmp/`, a completeness marker last, then the
   folder is renamed; a crash at any point leaves the earlier checkpoints as they were,
   and a half-written folder is never mistaken for a complete one (write_checkpoint's
   comments give each step and its reason).
2. Model and optimizer go through torch.distributed.checkpoint with fully qualified names,
   not through torch.save of each rank's state, so a checkpoint loads on another world size.
3. The trainer state is replicated on every rank, so rank 0 alone writes it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import warnings
from typing import TYPE_CHECKING

import torch

from distributed import rank_world

if TYPE_CHECKING:
    from config import TrainConfig


CKPT_SUBDIR = "ckpt"  # under out_dir: one folder per checkpoint, step_<position>
COMPLETE_MARKER = "COMPLETE"  # written last inside the temporary folder: its presence means every file is there
DCP_SINGLE_PROCESS_WARNING = "torch.distributed is disabled"  # DCP's note that one process saves alone: expected here


def _barrier():
    # A no-op on one process, where there is no process group to wait on.
    if rank_world()[1] > 1:
        import torch.distributed as dist
        dist.barrier()


def _fsync_dir(path: str):
    # fsync of a file makes its bytes durable, not its name: the directory's entries (a new file,
    # a rename) are only durable once the directory itself is fsynced.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_trainer_state(path: str, state: dict):
    # Its own function so that a test can make it raise, to crash a save midway.
    torch.save(state, path)


def latest_checkpoint(out_dir: str) -> str | None:
    """The newest complete checkpoint folder under out_dir/ckpt (by position), or None.

    Temporary folders (a save that crashed) and folders without the marker are ignored.
    """
    root = os.path.join(out_dir, CKPT_SUBDIR)
    if not os.path.isdir(root):
        return None
    # Positions are zero-padded to 8 digits, so the names sort in position order.
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
    # 1. A fresh temporary folder. Its `.tmp` name keeps latest_checkpoint off it until step 7.
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that crashed
        os.makedirs(tmp)
    _barrier()  # no rank may write into tmp before it exists
    # 2. Every rank writes its own shards; DCP fsyncs each file it writes. get_state_dict names
    # parameters and optimizer state by their unwrapped names, not by rank-local ids, which is
    # what lets another world size or wrapping load them.
    model_sd, optim_sd = get_state_dict(model, opt)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=DCP_SINGLE_PROCESS_WARNING)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp)
    # 3. The replicated trainer state and the resolved config, from rank 0 only.
    if rank == 0:
        _write_trainer_state(os.path.join(tmp, "trainer_state.pt"), trainer_state)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            f.write(json.dumps(dataclasses.asdict(cfg), default=str, indent=1))
    _barrier()  # every rank's shards are written before the marker below may claim so
    if rank == 0:
        # 4. The marker, last, so its presence implies every other file was written; flushed and
        # fsynced before the rename, so a folder renamed into place never holds an empty marker.
        with open(os.path.join(tmp, COMPLETE_MARKER), "w") as f:
            f.write(f"{position}\n")
            f.flush()
            os.fsync(f.fileno())
        # 5. The folder's entries (every file's name, the marker's too) made durable before the
        # rename can be, so a renamed folder never comes back from a crash without them.
        _fsync_dir(tmp)
        # 6. os.rename cannot replace a non-empty directory, so a folder left at this position goes
        # first. A crash between this and the rename loses only that folder; tmp stays ignored.
        if os.path.exists(final):  # a run resumed from an older checkpoint passes this position again
            shutil.rmtree(final)
        # 7. The rename is atomic within one filesystem: a reader sees no step_<position> or the
        # complete one, never part of it.
        os.rename(tmp, final)
        # 8. The rename made durable: the parent directory's entry changed, so fsync the parent.
        _fsync_dir(root)
        # 9. Only now, with the new checkpoint complete and durable, are older ones deleted, so
        # at every moment at least one complete checkpoint exists. (ckpt_keep <= 0 would keep all,
        # but train.check_config accepts >= 1 only.)
        done = sorted(n for n in os.listdir(root) if n.startswith("step_") and not n.endswith(".tmp"))
        for name in done[:-cfg.ckpt_keep] if cfg.ckpt_keep > 0 else []:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    _barrier()  # no rank goes on (or exits) before rank 0 has put the checkpoint in place
    return final


def read_checkpoint(path: str, model, opt) -> dict:
    """Load model and optimizer from a write_checkpoint folder (in place; any world size's
    shards) and return its trainer state. Raises ValueError if the folder is not complete."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    # An explicitly given folder need not have come from write_checkpoint's rename: check the marker.
    if not os.path.exists(os.path.join(path, COMPLETE_MARKER)):
        raise ValueError(f"{path} is not a complete checkpoint (no {COMPLETE_MARKER} marker)")
    # This rank's current state dicts are the template: DCP loads in place into their tensors, each
    # rank reading only the slices its own shards cover, whatever world size wrote them.
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=DCP_SINGLE_PROCESS_WARNING)
        dcp.load(state, checkpoint_id=path)
    # The optimizer's state came keyed by parameter name; set_state_dict maps it back to this
    # optimizer's own parameters.
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    # weights_only=False: the trainer state holds plain Python objects (random's state, the filter
    # history) that the safe loader refuses. It unpickles, so load only checkpoints you trust.
    return torch.load(os.path.join(path, "trainer_state.pt"), weights_only=False)


def rng_state() -> dict:
    """torch (CPU and CUDA) and python `random` generator states."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        # Every visible GPU's generator, not only the current one's.
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict):
    """Restore what rng_state() returned."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    # A checkpoint written on a CPU machine has no CUDA states; one resumed on a CPU machine has no
    # GPU to restore them to. Either way the CPU generators above are restored.
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def resume_path(cfg: TrainConfig) -> str | None:
    """The checkpoint to resume from: cfg.resume "" (none), "auto" (newest complete in out_dir, if any) or a folder."""
    if not cfg.resume:
        return None
    if cfg.resume == "auto":
        # None when there is none yet, so the same command starts a run and resumes it after a crash.
        return latest_checkpoint(cfg.out_dir)
    if not os.path.exists(os.path.join(cfg.resume, COMPLETE_MARKER)):
        raise ValueError(f"resume={cfg.resume!r}: not a complete checkpoint folder (valid: '', 'auto', or a folder "
                         f"under {os.path.join(cfg.out_dir, CKPT_SUBDIR)} holding {COMPLETE_MARKER})")
    return cfg.resume
