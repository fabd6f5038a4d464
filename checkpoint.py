"""Checkpoints: resumable state with torch.distributed.checkpoint.

This file owns everything a run writes to resume from (the final model is hf.save_hf's, in the
hub layout):
- write_checkpoint saves model and optimizer (each rank its shards) plus the replicated
  trainer state (RNG states, data position, filter history, length predictor, evals) to
  out_dir/ckpt/step_<position>/, atomically, and keeps the newest cfg.ckpt_keep;
- read_checkpoint loads one written by any number of ranks into a model and optimizer;
- resume_checkpoint picks the folder `resume=` names (`auto`: the newest complete one that
  loads, skipping with a warning any newer one that does not) and returns its trainer state;
  rng_state / set_rng_state carry the generators across.
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
4. A complete checkpoint can still fail to load (a file truncated or deleted afterwards: a full
   disk, a copy cut short, a hand). `load_trainer_state` checks every file resuming reads before
   anything is built: DCP's index, that each shard holds the bytes the index points to,
   trainer_state.pt and config.json. resume=auto falls back past one that fails; pruning counts
   only checkpoints up to the one just written, so such a newer one, which the resumed run replaces
   when it reaches that position, never pushes a loadable one out of the ckpt_keep kept.
5. A save's collectives (DCP's plan exchange and the gather of write results after it, the barriers here)
   wait on the slowest rank's writes (a load's on its reads): at 100B, about 1.28 TB of fp32 weights and AdamW state, far
   longer than a dist_timeout_s that catches a dead rank quickly. Under several ranks they run on
   a process group of their own whose timeout is sized at each save by the bytes the busiest rank
   writes (save_timeout_s), so a healthy save never races dist_timeout_s, and a dead rank still
   ends the job, later. That group is a gloo one (DCP exchanges only metadata on it).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import random
import warnings
from typing import TYPE_CHECKING

import torch

from distributed import all_gather_list, all_reduce_float, barrier, collective_group, rank_world
from weights import local

if TYPE_CHECKING:
    from config import TrainConfig


CKPT_SUBDIR = "ckpt"  # under out_dir: one folder per checkpoint, step_<position>
COMPLETE_MARKER = "COMPLETE"  # written last inside the temporary folder: its presence means every file is there
DCP_SINGLE_PROCESS_WARNING = "torch.distributed is disabled"  # DCP's note that one process saves alone: expected here
WRITE_BYTES_PER_S = 200e6
"""Bytes per second each rank is assumed to write while every rank writes at once: an assumption, not a measurement,
and a conservative one for a shared network filesystem (NFS, Lustre, a cloud file store) under a whole job's load."""
SAVE_TIMEOUT_FACTOR = 3  # over the bytes' time at WRITE_BYTES_PER_S: stragglers, contention with other jobs
SAVE_ALLOWANCE_S = 300.0  # over any size: DCP's planning, the fsyncs, the rename, deleting the oldest checkpoint

_save_group = (None, None)  # (the default group, the group saves run on) once made; see _save_group_for
_logged_timeout_s = None  # the save timeout last printed: printed again only if it changes


def save_timeout_s(nbytes_per_rank: int, dist_timeout_s: float) -> float:
    """Seconds a save's collectives may wait: the time the busiest rank takes to write `nbytes_per_rank` bytes
    at WRITE_BYTES_PER_S, times SAVE_TIMEOUT_FACTOR, plus SAVE_ALLOWANCE_S; never less than dist_timeout_s."""
    return max(dist_timeout_s, nbytes_per_rank / WRITE_BYTES_PER_S * SAVE_TIMEOUT_FACTOR + SAVE_ALLOWANCE_S)


def local_bytes(state) -> int:
    """Bytes of the tensors in a (nested dict / list) state dict as this rank holds them: a DTensor's local shard."""
    if isinstance(state, torch.Tensor):
        t = local(state)
        return t.numel() * t.element_size()
    if isinstance(state, dict):
        return sum(local_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(local_bytes(v) for v in state)
    return 0  # hyperparameters and other plain values: negligible beside the tensors


def _save_group_for(nbytes: int, dist_timeout_s: float):
    # The process group a save runs its collectives on, its timeout set to save_timeout_s of the most bytes any
    # rank writes (`nbytes` is this rank's); None in one process, where nothing waits. Collective.
    global _save_group, _logged_timeout_s
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    if rank_world()[1] == 1:
        return None
    world, group = _save_group
    if world is not dist.group.WORLD:  # the first save of this process group: every rank saves, so all create it here
        # gloo, as torchtitan's async checkpoints: DCP exchanges only metadata on it (each rank writes its own
        # shards), and a gloo group costs no GPU memory, where an NCCL one would hold buffers outside the plan
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=dist_timeout_s))
        _save_group = (dist.group.WORLD, group)
    # Set at every save, not once: the bytes may grow (AdamW's state appears at its first step), and
    # set_group_timeouts, called again when the async producer makes its groups, resets every group's.
    with collective_group(group):
        most = int(all_reduce_float(float(nbytes), "max"))  # exact: float64 holds integers below 2**53
    timeout = save_timeout_s(most, dist_timeout_s)
    c10d._set_pg_timeout(datetime.timedelta(seconds=timeout), group)
    if rank_world()[0] == 0 and timeout != _logged_timeout_s:
        print(f"checkpoint saves time out after {timeout:.0f} s: {most / 1e9:.2f} GB on the busiest rank at "
              f"{WRITE_BYTES_PER_S / 1e6:g} MB/s x{SAVE_TIMEOUT_FACTOR} + {SAVE_ALLOWANCE_S:g} s "
              f"(dist_timeout_s={dist_timeout_s:g})", flush=True)
    _logged_timeout_s = timeout
    return group


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


def complete_checkpoints(out_dir: str) -> list[str]:
    """The complete checkpoint folders under out_dir/ckpt, newest (highest position) first.

    Temporary folders (a save that crashed) and folders without the marker are left out.
    """
    root = os.path.join(out_dir, CKPT_SUBDIR)
    if not os.path.isdir(root):
        return []
    # Positions are zero-padded to 8 digits, so the names sort in position order.
    names = sorted((n for n in os.listdir(root) if n.startswith("step_") and not n.endswith(".tmp")
                    and os.path.exists(os.path.join(root, n, COMPLETE_MARKER))), reverse=True)
    return [os.path.join(root, n) for n in names]


def latest_checkpoint(out_dir: str) -> str | None:
    """The newest complete checkpoint folder under out_dir/ckpt (by position), or None."""
    found = complete_checkpoints(out_dir)
    return found[0] if found else None


def write_checkpoint(out_dir: str, position: int, model, opt, trainer_state: dict, cfg: TrainConfig) -> str:
    """Save model and optimizer (torch.distributed.checkpoint, each rank its shards) and the
    replicated trainer state (RNGs, data position, filter history, length predictor; rank 0)
    to out_dir/ckpt/step_<position>, atomically: all is written to a `.tmp` folder, the
    completeness marker last, then the folder is renamed. A crash at any point leaves the
    previous checkpoints as they were. Keeps the newest cfg.ckpt_keep up to this position (choice 4).
    Collective; under several ranks its collectives wait up to save_timeout_s of the busiest rank's bytes,
    not cfg.dist_timeout_s (choice 5).
    Returns the checkpoint folder.
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict
    # get_state_dict names parameters and optimizer state by their unwrapped names, not by rank-local ids,
    # which is what lets another world size or wrapping load them.
    model_sd, optim_sd = get_state_dict(model, opt)
    rank, _ = rank_world()
    # rank 0 alone also writes the trainer state; its tensors count with its shards
    nbytes = local_bytes((model_sd, optim_sd)) + (local_bytes(trainer_state) if rank == 0 else 0)
    group = _save_group_for(nbytes, cfg.dist_timeout_s)
    with collective_group(group):  # barrier() below runs on it too
        return _write(out_dir, position, {"model": model_sd, "optim": optim_sd}, trainer_state, cfg, group)


def _write(out_dir: str, position: int, state: dict, trainer_state: dict, cfg: TrainConfig, group) -> str:
    # write_checkpoint's steps, its collectives on `group` (None: the default group)
    import shutil

    import torch.distributed.checkpoint as dcp
    rank, _ = rank_world()
    root = os.path.join(out_dir, CKPT_SUBDIR)
    final = os.path.join(root, f"step_{position:08d}")
    tmp = final + ".tmp"
    # 1. A fresh temporary folder. Its `.tmp` name keeps latest_checkpoint off it until step 7.
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that crashed
        os.makedirs(tmp)
    barrier()  # no rank may write into tmp before it exists
    # 2. Every rank writes its own shards; DCP fsyncs each file it writes.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=DCP_SINGLE_PROCESS_WARNING)
        dcp.save(state, checkpoint_id=tmp, process_group=group)
    # 3. The replicated trainer state and the resolved config, from rank 0 only.
    if rank == 0:
        _write_trainer_state(os.path.join(tmp, "trainer_state.pt"), trainer_state)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            f.write(json.dumps(dataclasses.asdict(cfg), default=str, indent=1))
    barrier()  # every rank's shards are written before the marker below may claim so
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
        # but its rule in config.TrainConfig accepts >= 1 only.)
        # Only folders up to this position count: a later one is left by an earlier attempt this run is redoing
        # (resume=auto skipped it as unloadable, or resume= named an older folder) and is replaced when the run
        # reaches its position; counted, a corrupt one would push a loadable one out (choice 4).
        done = sorted(n for n in os.listdir(root) if n.startswith("step_") and not n.endswith(".tmp")
                      and n <= os.path.basename(final))
        for name in done[:-cfg.ckpt_keep] if cfg.ckpt_keep > 0 else []:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    barrier()  # no rank goes on (or exits) before rank 0 has put the checkpoint in place
    return final


def read_checkpoint(path: str, model, opt, dist_timeout_s: float | None = None) -> dict:
    """Load model and optimizer from a write_checkpoint folder (in place; any world size's
    shards) and return its trainer state. Raises ValueError if the folder is not complete.
    Collective; given dist_timeout_s, under several ranks its collectives wait as a save's do (choice 5)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    # An explicitly given folder need not have come from write_checkpoint's rename: check the marker.
    if not os.path.exists(os.path.join(path, COMPLETE_MARKER)):
        raise ValueError(f"{path} is not a complete checkpoint (no {COMPLETE_MARKER} marker)")
    # This rank's current state dicts are the template: DCP loads in place into their tensors, each
    # rank reading only the slices its own shards cover, whatever world size wrote them.
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    group = None if dist_timeout_s is None else _save_group_for(local_bytes(state), dist_timeout_s)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=DCP_SINGLE_PROCESS_WARNING)
        dcp.load(state, checkpoint_id=path, process_group=group)
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


def load_trainer_state(path: str) -> dict:
    """Check that a checkpoint folder loads, with no model to load it into, and return its trainer state.

    Reads what resuming reads: config.json and trainer_state.pt in full, DCP's index (.metadata), and
    the size of every shard file the index points into, which must hold the bytes it points to. So a
    missing or truncated file of any kind is caught before anything is built; a flipped bit inside a
    shard is not (DCP keeps no checksums). Raises ValueError naming the folder, the file and the error.
    """
    import torch.distributed.checkpoint as dcp
    if not os.path.exists(os.path.join(path, COMPLETE_MARKER)):
        raise ValueError(f"{path} is not a complete checkpoint (no {COMPLETE_MARKER} marker)")
    name = "config.json"
    try:
        with open(os.path.join(path, name)) as f:
            json.load(f)
        name = ".metadata"  # DCP's index: where each tensor's bytes lie, by file, offset and length
        index = dcp.FileSystemReader(path).read_metadata().storage_data
        ends = {}
        for where in index.values():
            ends[where.relative_path] = max(ends.get(where.relative_path, 0), where.offset + where.length)
        for name, end in sorted(ends.items()):
            size = os.path.getsize(os.path.join(path, name))
            if size < end:
                raise ValueError(f"{size} bytes, but its index reaches byte {end}")
        name = "trainer_state.pt"
        # weights_only=False: see read_checkpoint.
        return torch.load(os.path.join(path, name), weights_only=False)
    except Exception as e:  # noqa: BLE001  whatever reading the file raised (OSError, EOFError, unpickling...)
        raise ValueError(f"checkpoint {path} does not load: {name}: {type(e).__name__}: {e}") from e


def resume_checkpoint(cfg: TrainConfig) -> tuple[str | None, dict | None]:
    """The checkpoint this run resumes from and its trainer state; (None, None) to start afresh.

    cfg.resume "": afresh. A folder: that one. "auto": the newest complete checkpoint in out_dir that
    loads (load_trainer_state); each newer one that does not is skipped with a warning naming it and
    why; none at all starts afresh, so the same command starts a run and resumes it after a crash.
    Raises ValueError when the named folder does not load, when under "auto" complete ones exist and
    none loads, or when the chosen one's model has another shape than cfg.model. Several ranks: rank 0
    chooses and the others take its choice (or its error), so all resume from the same folder.
    """
    if not cfg.resume:
        return None, None
    rank, world = rank_world()
    path, state, error = None, None, None
    if rank == 0:
        try:
            path, state = _choose_checkpoint(cfg)
        except ValueError as e:
            error = str(e)
    if world > 1:
        path, error = all_gather_list([(path, error)] if rank == 0 else [])[0]
    if error is not None:
        raise ValueError(error)
    if path is None:
        return None, None
    if state is None:  # not rank 0: the folder is checked; read its trainer state here too
        state = torch.load(os.path.join(path, "trainer_state.pt"), weights_only=False)
    with open(os.path.join(path, "config.json")) as f:
        saved = json.load(f)
    if saved["model"] != json.loads(json.dumps(dataclasses.asdict(cfg.model))):
        raise ValueError(f"resume: {path} holds a model of another shape: {saved['model']}")
    return path, state


def _choose_checkpoint(cfg: TrainConfig) -> tuple[str | None, dict | None]:
    # resume_checkpoint's choice on one process: (folder, trainer state), or (None, None) for none yet.
    if cfg.resume != "auto":
        try:  # valid: '', 'auto', or a complete checkpoint folder that loads
            return cfg.resume, load_trainer_state(cfg.resume)
        except ValueError as e:
            raise ValueError(f"resume={cfg.resume!r}: {e} (valid: '', 'auto', or a checkpoint folder)") from None
    candidates, errors = complete_checkpoints(cfg.out_dir), []
    for path in candidates:
        try:
            return path, load_trainer_state(path)
        except ValueError as e:
            errors.append(str(e))
            warnings.warn(f"{e}; resume=auto skips it for an older one", stacklevel=3)
    if candidates:
        raise ValueError(f"resume=auto: none of the {len(candidates)} complete checkpoints under "
                         f"{os.path.join(cfg.out_dir, CKPT_SUBDIR)} loads:\n" + "\n".join(errors)
                         + "\nrepair one and resume it by name, or move them away to start afresh")
    return None, None
