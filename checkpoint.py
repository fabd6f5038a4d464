"""Checkpoints: resumable state with torch.distributed.checkpoint.

This file owns everything a run writes to resume from (the final model is hf.save_hf's, in the
hub layout):
- write_checkpoint saves model and optimizer (each rank its shards) plus the replicated
  trainer state (RNG states, data position, filter history, length predictor, evals) to
  out_dir/ckpt/step_<position>/, atomically, and keeps the newest cfg.ckpt_keep;
- read_checkpoint loads one written by any number of ranks into a model and optimizer;
- resume_checkpoint picks the folder `resume=` names (`auto`: the newest complete one that
  loads, skipping with a warning any newer one that does not) and returns its trainer state;
  rng_state / set_rng_state carry the generators across;
- the run folder: check_run_folder (before any work: out_dir writable, with room for all the
  run writes, the final model included (run_bytes), apart from the init checkpoint, free of a
  live run, holding no other run's checkpoints) and lock_run_folder (run_lock.take_lock); rescue_folders, where a final
  model out_dir can no longer take goes instead (save_model: the final model, hf.save_hf).
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
6. A run folder holds one run. Its identity is its settings (run_settings: the resolved config less
   RESUMABLE, the settings that may change between a run and its resume), hashed into run_id; each
   checkpoint's config.json and out_dir/run_config.json record them. Resuming a checkpoint written
   with other settings is an error naming each one (old -> new) unless resume_changed is set; a
   fresh run refuses a folder holding another run's checkpoints, which resume=auto would continue.
7. One live run per folder: run_lock.py (take_lock), checked by check_run_folder, taken by lock_run_folder.
8. A full disk, a read-only folder or a missing permission during a save is one WriteError line
   naming the folder and the bytes it needed; the half-written `.tmp` folder is removed.
"""

from __future__ import annotations

import dataclasses
import datetime
import errno
import hashlib
import json
import os
import random
import shutil
import tempfile
import warnings
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError

from distributed import all_gather_list, all_reduce_float, barrier, collective_group, rank_world
from hf import save_hf
from metrics import WRITE_ERRNOS, WriteError, free_bytes, write_atomic, write_error
from run_lock import LOCK_FILE, lock_state, take_lock
from weights import local

if TYPE_CHECKING:
    from config import TrainConfig
    from tokenizer import Tokenizer


CKPT_SUBDIR = "ckpt"  # under out_dir: one folder per checkpoint, step_<position>
COMPLETE_MARKER = "COMPLETE"  # written last inside the temporary folder: its presence means every file is there
DCP_SINGLE_PROCESS_WARNING = "torch.distributed is disabled"  # DCP's note that one process saves alone: expected here
WRITE_BYTES_PER_S = 200e6
"""Bytes per second each rank is assumed to write while every rank writes at once: an assumption, not a measurement,
and a conservative one for a shared network filesystem (NFS, Lustre, a cloud file store) under a whole job's load."""
SAVE_TIMEOUT_FACTOR = 3  # over the bytes' time at WRITE_BYTES_PER_S: stragglers, contention with other jobs
SAVE_ALLOWANCE_S = 300.0  # over any size: DCP's planning, the fsyncs, the rename, deleting the oldest checkpoint

CKPT_BYTES_PER_PARAM = 12  # a checkpoint holds fp32 weights and AdamW's two fp32 moments (whatever the compute dtype)
MODEL_BYTES_PER_PARAM = 4  # the final model (hf.save_hf) in the parameters' own dtype: fp32 (distributed.build_model)
RUN_FILES_BYTES = 64 << 20
"""Room kept for the run's small files: the tokenizer's (a hub tokenizer.json is up to ~35 MB), run_config.json,
plot.png, and metrics.jsonl beside METRICS_BYTES_PER_STEP."""
METRICS_BYTES_PER_STEP = 4096  # a metrics.jsonl record (an RL step's, an eval's) is about 1-2 KB
RESUMABLE = (
    # where and how a run starts, not what it is
    "out_dir", "resume", "resume_changed", "dry_run",
    # its length: RL's learning rate is constant after warm-up, so more (or fewer) RL steps leave the others alone
    "rl_steps",
    # what it reports and keeps, not what it trains: evals sample from their own seeded streams, not torch's RNG
    "logger", "eval_every", "eval_before_rl", "eval_batch_rows", "ckpt_every", "ckpt_keep",
    # the machine at hand: checkpoints load on any world size, batching leaves what is sampled as it was, and
    # micro-batches, recompute and compile change how a step is computed, not what it computes
    "device", "gpus_per_node", "ep", "dist_timeout_s", "activation_checkpoint", "compile", "gen_batch_rows",
    "microbatch_tokens", "rollout_threads", "trainer_threads", "engine.sglang_urls", "engine.sglang_mem_fraction",
    "engine.slots", "engine.page_size", "engine.kv_tokens", "engine.prefill_tokens", "engine.cuda_graph",
    "reward.workers", "reward.rm_shard",
)
"""The settings (section fields dotted) that may differ between a run and its resume without making it another run;
every other setting is the run's identity (choice 6)."""

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
    # Its own function so that a test can make it raise, to crash a save midway. Written beside, then renamed:
    # trainer_state.pt is whole or absent, as every file of a checkpoint folder.
    torch.save(state, path + ".part")
    os.replace(path + ".part", path)


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
    Returns the checkpoint folder. Raises WriteError (a full disk, no permission) with no `.tmp` folder left (choice 8).
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict
    # get_state_dict names parameters and optimizer state by their unwrapped names, not by rank-local ids,
    # which is what lets another world size or wrapping load them.
    model_sd, optim_sd = get_state_dict(model, opt)
    rank, _ = rank_world()
    # rank 0 alone also writes the trainer state; its tensors count with its shards
    nbytes = local_bytes((model_sd, optim_sd)) + (local_bytes(trainer_state) if rank == 0 else 0)
    group = _save_group_for(nbytes, cfg.dist_timeout_s)
    tmp = os.path.join(out_dir, CKPT_SUBDIR, f"step_{position:08d}.tmp")
    if free_bytes(os.path.dirname(tmp)) < nbytes:  # before a byte is written
        raise write_error(tmp, OSError(errno.ENOSPC, "no space"), nbytes)
    with collective_group(group):  # barrier() below runs on it too
        try:
            return _write(out_dir, position, {"model": model_sd, "optim": optim_sd}, trainer_state, cfg, group)
        except BaseException as e:  # DCP's CheckpointException, which carries each rank's, is no Exception
            failure = _write_failure(e, tmp, nbytes)
            if failure is None and not isinstance(e, WriteError):
                raise
            error = e if failure is None else write_error(tmp, failure, nbytes)  # the free bytes as it failed
            if rank == 0:  # nothing partial left: the earlier checkpoints stay as they were (choice 8)
                shutil.rmtree(tmp, ignore_errors=True)
            raise error from None


def _write_failure(e: BaseException, folder: str, nbytes: int) -> OSError | None:
    # The OSError of WRITE_ERRNOS behind a failed save of nbytes into `folder` (DCP wraps each rank's in
    # CheckpointException.failures), or None. torch.save's zip writer reports a write the disk cut short without
    # its errno ("unexpected pos"): a full disk when less room is left than the save needed.
    if isinstance(e, OSError):
        return e if e.errno in WRITE_ERRNOS else None
    if isinstance(e, RuntimeError) and "unexpected pos" in str(e) and free_bytes(folder) < nbytes:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    for exc, _ in getattr(e, "failures", {}).values():
        if (found := _write_failure(exc, folder, nbytes)) is not None:
            return found
    return None


def _write(out_dir: str, position: int, state: dict, trainer_state: dict, cfg: TrainConfig, group) -> str:
    # write_checkpoint's steps, its collectives on `group` (None: the default group)
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
        write_atomic(os.path.join(tmp, "config.json"), json.dumps(dataclasses.asdict(cfg), default=str, indent=1))
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
    none loads, when the chosen one's model has another shape than cfg.model, or when it was written
    with other settings (run_settings) and cfg.resume_changed is not set; with it set, each change is
    printed. Several ranks: rank 0 chooses and the others take its choice (or its error), so all
    resume from the same folder.
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
    changes = changed_settings(saved, cfg)
    if changes and not cfg.resume_changed:  # choice 6
        raise ValueError(f"resume={cfg.resume!r}: {path} was written with other settings (checkpoint -> this "
                         f"run: {'; '.join(changes)}): resume with its settings, set resume_changed=True to continue "
                         f"it with these, or start this run in another out_dir")
    if changes and rank == 0:
        print(f"resume_changed=True: {path} continues with changed settings (checkpoint -> this run: "
              f"{'; '.join(changes)})", flush=True)
    if "phase" in state:  # a checkpoint written before the SFT / RL stage was named "stage"
        state["stage"] = state.pop("phase")
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


# ----------------------------------------------------------------------------- the run folder (choices 6, 7)

def config_dict(cfg: TrainConfig) -> dict:
    """cfg as its config.json holds it (tuples as lists, other values as JSON reads them back)."""
    return json.loads(json.dumps(dataclasses.asdict(cfg), default=str))


def run_settings(config: dict) -> dict:
    """A run's identity: the settings of a config dict (config_dict, or a config.json), section fields dotted,
    less RESUMABLE."""
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):  # a section
            flat.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            flat[key] = value
    return {k: v for k, v in flat.items() if k not in RESUMABLE}


def run_id(config: dict) -> str:
    """A short hash of run_settings: two configs of one run have the same."""
    return hashlib.sha256(json.dumps(run_settings(config), sort_keys=True).encode()).hexdigest()[:12]


def changed_settings(saved: dict, cfg: TrainConfig) -> list[str]:
    """'name: old -> new' for each setting of run_settings in which cfg differs from a config.json's `saved`. A
    setting `saved` lacks (a field added since) counts as its default; one cfg lacks (removed since) as no change."""
    old, new = run_settings(saved), run_settings(config_dict(cfg))
    default = run_settings(config_dict(type(cfg)()))

    def shown(v):
        text = repr(v)
        return text if len(text) <= 60 else text[:57] + "..."
    return [f"{key}: {shown(old.get(key, default[key]))} -> {shown(value)}" for key, value in new.items()
            if old.get(key, default[key]) != value]


def run_bytes(cfg: TrainConfig, num_params: int) -> dict[str, int]:
    """The bytes the run adds to out_dir's filesystem at its fullest, by what they are (an error names each): the
    final model, the checkpoints on disk at once (a save writes the new one before it deletes the oldest: up to
    ckpt_keep + 1, fewer when the run saves fewer; those already in out_dir count against them, a save's room
    kept), and the small files. num_params: the model's (plan.param_counts' total)."""
    steps = cfg.sft_steps + cfg.rl_steps
    saves = steps // cfg.ckpt_every if cfg.ckpt_every else 0
    ckpts = max(min(saves, 1), min(saves, cfg.ckpt_keep + 1) - len(complete_checkpoints(cfg.out_dir)))
    parts = {f"the final model ({MODEL_BYTES_PER_PARAM} bytes a parameter, {num_params:,} of them)":
             MODEL_BYTES_PER_PARAM * num_params}
    if ckpts:
        parts[f"{ckpts} checkpoint{'s' * (ckpts > 1)} at once (ckpt_every={cfg.ckpt_every}, ckpt_keep="
              f"{cfg.ckpt_keep}: {CKPT_BYTES_PER_PARAM} bytes a parameter)"] = ckpts * CKPT_BYTES_PER_PARAM * num_params
    parts["tokenizer, metrics and config files"] = RUN_FILES_BYTES + METRICS_BYTES_PER_STEP * steps
    return parts


def rescue_folders(out_dir: str) -> list[str]:
    """Where a final model that out_dir could not take is written instead, in order: <out_dir>.rescue-<pid> beside
    it, then the same name under $TMPDIR (tempfile.gettempdir()), another filesystem where out_dir's is full."""
    out = os.path.abspath(out_dir)
    name = f"{os.path.basename(out)}.rescue-{os.getpid()}"
    return list(dict.fromkeys([os.path.join(os.path.dirname(out), name), os.path.join(tempfile.gettempdir(), name)]))


def no_room(folder: str, needed: int) -> str | None:
    """Why `folder` cannot take `needed` bytes (its filesystem's free bytes, or why they cannot be read), else None."""
    try:
        free = free_bytes(folder)
    except OSError as e:
        return f"{folder}: its free space cannot be read ({e.strerror or e})"
    return f"{folder}: {free:,} bytes free, the model needs about {needed:,}" if free < needed else None


def save_model(model: torch.nn.Module, tok: Tokenizer, cfg: TrainConfig, num_params: int):
    """The final policy in the HF hub layout in out_dir: config.json and safetensors (hf.save_hf, a
    parameter at a time, written by rank 0 shard by shard) with the tokenizer files beside them, so
    transformers, SGLang and this project's init_hf/init_from load it. num_params: the model's (plan.param_counts),
    which sizes the room a rescue folder needs. Collective.

    The model exists only in memory until it is written, so a write that fails (the disk filled during the run, the
    folder made read-only) is retried in a rescue folder (rescue_folders: beside out_dir, else under
    $TMPDIR), each first checked for room. Raises WriteError either way: naming where the model went, or, when no
    folder took it, each failure and the newest checkpoint, the last good state left."""
    failure = _save_model_in(model, tok, cfg.out_dir)
    if failure is None:
        return
    rank0 = rank_world()[0] == 0
    needed = MODEL_BYTES_PER_PARAM * num_params + RUN_FILES_BYTES
    tried = []
    for folder in all_gather_list(rescue_folders(cfg.out_dir) if rank0 else []):  # rank 0's, which writes
        why = all_gather_list([no_room(folder, needed) if rank0 else None])[0]
        if why is None:
            made = not os.path.exists(folder)
            if (why := _save_model_in(model, tok, folder)) is None:
                raise WriteError(f"{failure}; the trained model is saved in {folder} instead (config.json, "
                                 f"safetensors and tokenizer files, as out_dir would hold them): move them into "
                                 f"{cfg.out_dir} once there is room, or load them from there (init_from={folder!r})")
            if made and rank0:  # nothing partial left
                shutil.rmtree(folder, ignore_errors=True)
        tried.append(why)
    newest = latest_checkpoint(cfg.out_dir)
    raise WriteError(f"{failure}; no rescue folder took it either ({'; '.join(tried)}): the trained model is lost; "
                     + (f"the newest checkpoint ({newest}) holds the last good state (resume=auto continues from "
                        f"it once there is room)" if newest else f"no checkpoint was written (ckpt_every="
                        f"{cfg.ckpt_every})"))


def _save_model_in(model: torch.nn.Module, tok: Tokenizer, folder: str) -> str | None:
    # save_model's one attempt, collective: None, or rank 0's failure (every rank gets it, to retry together)
    write, failure = rank_world()[0] == 0, None
    try:
        save_hf(model, folder, write=write)
        if write:
            tok.save(folder)
    except OSError as e:  # a full disk, a folder made read-only during the run
        failure = str(write_error(folder, e))
    except SafetensorError as e:  # safetensors' own error for a failed write, naming the OS's
        failure = f"cannot write the model in {folder}: {e}"
    return all_gather_list([failure])[0]


def check_run_folder(cfg: TrainConfig, needed: dict[str, int] | None = None, lock: bool = True):
    """out_dir can hold this run, checked before any work without writing there: it is (or can be made) a folder
    this process can write in, with room for what the run writes (`needed`: run_bytes' parts; None: not
    checked, as a dry run plans for another machine); it is not, inside or around the init_hf / init_from
    checkpoint (their realpaths); with `lock` (rank 0: the others would see its own), no live run holds it
    (take_lock's file); unless the run resumes one of out_dir's checkpoints (which resume_checkpoint checks) or
    resume_changed names another folder's, every checkpoint in it is this run's (run_settings), so resume=auto
    can never continue another run's. Raises ValueError naming out_dir and the reason."""
    out = cfg.out_dir
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"out_dir={out!r}: a file is there; need a folder (or nothing, to create one)")
    real = os.path.realpath(out)
    for key in ("init_hf", "init_from"):
        src = getattr(cfg, key)
        if not src:
            continue
        init = os.path.realpath(src)
        if real == init or real.startswith(init + os.sep) or init.startswith(real + os.sep):
            where = "is" if real == init else "is inside" if real.startswith(init + os.sep) else "holds"
            harm = "would be written over it" if where != "holds" else "would sit beside it, mixed with it"
            raise ValueError(f"out_dir={out!r} {where} the {key} folder {src!r}: the run's model.safetensors, "
                             f"config.json, tokenizer files and checkpoints {harm}; write the run to a folder apart "
                             f"from it")
    existing = real
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(f"out_dir={out!r}: {existing} is a file, so no folder can be made under it")
    try:  # a folder made and removed at once: the one way to know, whatever the filesystem and the user's rights
        os.rmdir(tempfile.mkdtemp(prefix=".write-check-", dir=existing))
    except OSError as e:
        raise ValueError(f"out_dir={out!r}: cannot write in {existing}: {os.strerror(e.errno) if e.errno else e}"
                         ) from None
    if needed and (free := free_bytes(existing)) < sum(needed.values()):
        parts = "; ".join(f"{what}: {n:,}" for what, n in needed.items())
        raise ValueError(f"out_dir={out!r}: {free:,} bytes free on its filesystem; the run writes about "
                         f"{sum(needed.values()):,} ({parts}); free space, or write the run elsewhere")
    busy = lock_state(os.path.join(out, LOCK_FILE))[2] if lock else None
    if busy:
        raise ValueError(f"out_dir={out!r} is in use: {busy}")
    own = cfg.resume == "auto" or os.path.realpath(cfg.resume).startswith(os.path.join(real, CKPT_SUBDIR, ""))
    if cfg.resume and (own or cfg.resume_changed):
        return  # resume_checkpoint holds the checkpoint to this run's settings (or prints how they changed)
    for ckpt in complete_checkpoints(out):
        try:
            with open(os.path.join(ckpt, "config.json")) as f:
                changes = changed_settings(json.load(f), cfg)
        except (OSError, ValueError, AttributeError) as e:  # missing, not JSON, not an object
            changes = [f"its config.json does not read: {e}"]
        if not changes and not cfg.resume and not cfg.dry_run:
            warnings.warn(f"out_dir={out!r} holds this run's checkpoints ({ckpt}): it starts over and replaces them "
                          f"(resume=auto would continue from there)", stacklevel=2)
            return
        if changes:
            raise ValueError(f"out_dir={out!r} holds another run's checkpoints ({ckpt} -> this run: "
                             f"{'; '.join(changes)}): this run would write beside them, and resume=auto would "
                             f"continue theirs; write this run to another out_dir, move {os.path.dirname(ckpt)} "
                             f"away, or resume that run with its settings")


def lock_run_folder(cfg):
    """Rank 0 takes out_dir's lock (`take_lock`) for the run of cfg (config.TrainConfig), making out_dir; every rank
    learns its error, if any, so all stop alike. Returns the lock on rank 0, None on the others. Collective under
    torchrun."""
    rank, world = rank_world()
    lock, error = None, None
    if rank == 0:
        try:
            lock = take_lock(cfg.out_dir, run_id(config_dict(cfg)))
        except ValueError as e:
            error = str(e)
    if world > 1:
        error = all_gather_list([error] if rank == 0 else [])[0]
    if error is not None:
        raise ValueError(error)
    return lock
