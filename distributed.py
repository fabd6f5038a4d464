"""Several ranks under torchrun: the process group, torchtitan meshes, the sharded policy, collectives.

`torchrun --nproc_per_node=N train.py ... ep=E` runs train.main on N ranks: FSDP2 over all
of them and the experts sharded over E (`parallelize`, below; torchtitan's ParallelDims and
all-to-all token dispatch). This file owns what differs when there are several ranks:
joining the job (setup_distributed), building the sharded policy and its frozen KL
reference (build_model, reference_copy), gathering full tensors for the engine and the
checkpoints, and the few collectives the trainer calls. With one process every helper
here is a no-op or a plain call; the step asks `rank_world()` only where ranks split work.

Notable choices:
1. The policy starts from exactly the weights one process would build, in fp32 on every
   rank, so the multi-rank losses equal the 1-process run's to float rounding.
2. Every rank runs the same number of forwards and backwards: FSDP's all-gathers and the
   expert all-to-all are collectives, so a rank with less data runs idle ones
   (padded_microbatches, idle_forward) rather than leave the others waiting.
3. A rank that dies makes the others' next collective fail after cfg.dist_timeout_s,
   instead of hanging the job forever.
"""

from __future__ import annotations

import os
import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from model import Transformer
from weights import local

if TYPE_CHECKING:
    from config import TrainConfig


@dataclass
class Meshes:
    """The device meshes a policy is sharded over: FSDP over `fsdp` (every rank), the experts split
    over `ep` (None: not expert-parallel) and each expert FSDP-sharded over `efsdp` (None: one
    copy of each expert, on one rank of its ep group)."""
    fsdp: DeviceMesh
    ep: DeviceMesh | None = None
    efsdp: DeviceMesh | None = None


def build_meshes(world_size: int, ep: int = 1) -> Meshes:
    """The meshes of world_size ranks, all data-parallel (FSDP), the experts split over ep of them,
    built with torchtitan's ParallelDims.

    The default process group must already be initialised. On a machine without CUDA the
    meshes are CPU (gloo) meshes: torchtitan assumes CUDA unless told, and its DTensor-only
    ("partial_dtensor") SPMD backend is the one that runs there.
    """
    # Imported for its side effect: it registers the "fake" backend torchtitan gives size-1 mesh dims.
    import torch.testing._internal.distributed.fake_pg  # noqa: F401
    import torchtitan.distributed.parallel_dims as titan_dims
    from torchtitan.distributed.utils import set_spmd_backend
    if not torch.cuda.is_available():
        # torchtitan builds its meshes on the device_type it detected at import, "cuda" when it
        # finds no accelerator at all; a CPU mesh is what makes its process groups gloo ones.
        titan_dims.device_type = "cpu"
    # torchtitan reads the SPMD backend in two places: its runtime helpers (the token
    # dispatcher) read this global, ParallelDims its own field below; both must agree.
    set_spmd_backend("partial_dtensor")
    # dp_replicate, cp, tp and pp stay 1: this project shards data and experts only.
    dims = titan_dims.ParallelDims(dp_replicate=1, dp_shard=world_size, cp=1, tp=1, pp=1, ep=ep,
                                   world_size=world_size, spmd_backend="partial_dtensor")
    dims.build_mesh()
    efsdp = world_size // ep  # the ranks left to shard each expert over once ep has split them
    return Meshes(fsdp=dims.get_mesh("fsdp"), ep=dims.get_mesh("ep") if ep > 1 else None,
                  efsdp=dims.get_mesh("efsdp") if ep > 1 and efsdp > 1 else None)


def own_meshes(world_size: int, ep: int = 1) -> Meshes:
    """Meshes laid out as `build_meshes` lays them out (ep groups of consecutive ranks, efsdp groups
    strided by ep: torchtitan's ["efsdp", "ep"] order), so a model parallelized on them holds the same
    shards, but over process groups of their own: the async producer's collectives then never share a
    communicator with the trainer's. (A mesh dim spanning every rank would otherwise reuse the default
    group, as torchtitan's meshes do.) Every rank must call it: each group is created by all ranks."""
    import torch.distributed as dist
    rank, dev = dist.get_rank(), "cuda" if torch.cuda.is_available() else "cpu"

    def mesh(groups: list[list[int]], name: str) -> DeviceMesh:
        for ranks in groups:  # every rank creates every group, in the same order
            group = dist.new_group(ranks)
            if rank in ranks:
                mine = DeviceMesh.from_group(group, dev, mesh=torch.tensor(ranks), mesh_dim_names=(name,))
        return mine

    efsdp = world_size // ep
    return Meshes(fsdp=mesh([list(range(world_size))], "fsdp"),
                  ep=mesh([list(range(i, i + ep)) for i in range(0, world_size, ep)], "ep") if ep > 1 else None,
                  efsdp=mesh([list(range(j, world_size, ep)) for j in range(ep)], "efsdp") if ep > 1 and efsdp > 1
                  else None)


def rank_world() -> tuple[int, int]:
    """(rank, world size) of the default process group, or (0, 1) when not distributed."""
    import torch.distributed as dist
    # is_available is False on torch builds without distributed support; is_initialized is
    # False in a plain `python train.py` run, which must work without torchrun.
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def setup_distributed(cfg: TrainConfig) -> Meshes | None:
    """The process group and the meshes the policy is sharded over, or None for a plain one-process model.

    Under torchrun (WORLD_SIZE > 1): join the job (nccl with CUDA, else gloo; every collective
    fails after cfg.dist_timeout_s instead of waiting for a dead rank forever), dp_shard = world
    size and ep = cfg.ep (torchtitan's meshes), cfg.device set to this rank's GPU. One process
    in bf16: a one-rank group and mesh, so FSDP2's mixed precision runs the same arithmetic as
    on many ranks (bf16 compute, fp32 master weights and gradients). One process in fp32: None.
    (config.RELATIONS has refused an ep that does not divide the world size.)
    """
    import datetime

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    world = int(os.environ.get("WORLD_SIZE", "1"))  # set by torchrun; absent in a plain python run
    timeout = datetime.timedelta(seconds=cfg.dist_timeout_s)
    # nccl runs collectives on GPU tensors only and gloo on CPU tensors, so the backend follows where the weights live
    backend = "nccl" if torch.device(cfg.device).type == "cuda" else "gloo"
    if world == 1:
        if cfg.ep > 1:  # not an error: a recipe written for torchrun still runs (and is tested) in one process
            import warnings
            warnings.warn(f"ep={cfg.ep} has no effect in one process: every expert is local (run under torchrun "
                          f"with a world size divisible by ep to split them)", stacklevel=2)
        if cfg.compute_dtype() == torch.float32:
            return None
        # a store of its own: one rank needs no rendezvous (and no MASTER_ADDR / MASTER_PORT)
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return Meshes(fsdp=init_device_mesh(torch.device(cfg.device).type, (1,), mesh_dim_names=("fsdp",)))
    if torch.cuda.is_available():
        # One GPU per rank, chosen by the rank's index on its node; made current before the
        # process group starts, so that nccl's communicators (and "cuda" tensors) use it, not
        # cuda:0 on every rank.
        cfg.device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.cuda.set_device(cfg.device)
        backend = "nccl"
    dist.init_process_group(backend, timeout=timeout)  # the timeout turns a hung or dead peer into an error
    meshes = build_meshes(world, cfg.ep)
    set_group_timeouts(cfg.dist_timeout_s)
    return meshes


def set_group_timeouts(seconds: float):
    """Every process group this process has waits at most `seconds` for the other ranks: torch gives the
    groups created after the default one (each mesh dim's, torchtitan's, own_meshes') its own 30-minute
    default, not init_process_group's timeout. Through torch's private _set_pg_timeout: there is no public
    setter. A fake backend (a size-1 mesh dim's) has no timeout."""
    import datetime

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    for group in list(c10d._world.pg_map):
        if dist.get_backend(group) in ("gloo", "nccl"):
            c10d._set_pg_timeout(datetime.timedelta(seconds=seconds), group)


def mixed_precision(cfg: TrainConfig) -> dict:
    """parallelize's dtypes for cfg: bf16 compute with fp32 gradient reductions, or fp32 throughout."""
    if cfg.compute_dtype() == torch.float32:
        return dict(param_dtype=None, reduce_dtype=None)  # the parameters' own fp32, as on one plain process
    return dict(param_dtype=cfg.compute_dtype(), reduce_dtype=torch.float32)


def build_model(cfg: TrainConfig, meshes: Meshes | None = None, init_state: dict | None = None) -> Transformer:
    """The policy: a plain Transformer, or (meshes given) built on meta, parallelized, then filled.

    Weights come from init_state (a full state dict) or, absent it, from a full model
    initialised on CPU under the current torch seed, so N ranks start from exactly the
    weights one process would (every rank builds the same full model, then keeps its slice).
    With cfg.init_hf (or cfg.init_from, an earlier run's output in the same layout) the weights
    come from that HF checkpoint instead (hf.load_hf; a sharded model is built on meta and each
    rank reads only its slice, never the full model).
    Parameters, gradients and optimizer state are fp32; in bf16 FSDP gathers the weights in bf16
    for the forward and backward (`mixed_precision`). In fp32 multi-rank losses match the
    1-process run to float rounding.
    Raises ValueError (from load_hf) if the checkpoint lacks a tensor or has another shape.
    """
    from hf import load_hf
    source = cfg.init_hf or cfg.init_from  # a hub-layout folder, or "" for a random init
    if meshes is None:
        model = Transformer(cfg.model)
        if source and init_state is None:
            load_hf(source, model)
        model = model.to(cfg.device)
        if init_state is not None:
            model.load_state_dict(init_state)
        return checkpoint_and_compile(model, activation_checkpoint=cfg.activation_checkpoint, compile=cfg.compile)
    if source and init_state is None:
        # Every weight comes from the checkpoint, so no rank needs an initialised full model:
        # build the shapes on meta, shard them, allocate only this rank's slices, then read them.
        with torch.device("meta"):
            model = Transformer(cfg.model)
        parallelize(model, meshes, **mixed_precision(cfg), activation_checkpoint=cfg.activation_checkpoint,
                    compile=cfg.compile)
        model.to_empty(device=cfg.device)  # allocated, not initialised: load_hf fills every parameter
        with torch.no_grad():
            # The only buffer is the router's expert bias: 0 at init, as in a fresh model (to_empty left it
            # uninitialised memory); load_hf overwrites it where the checkpoint stores one (GLM-4.5's).
            for b in model.buffers():
                b.zero_()
        load_hf(source, model, offsets=shard_offsets(model))  # each rank reads only its slices
        return model
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    # Why every rank builds the whole model before keeping its slice: the init draws from torch's
    # RNG parameter by parameter, so only the full model, built in the same order under the same
    # seed, draws exactly what a 1-process run draws. A sharded init would draw other numbers and
    # break the bitwise parity with the 1-process run. It costs one full fp32 copy per rank on CPU,
    # freed on return; init_hf (above) avoids it for models too big for that.
    full = Transformer(cfg.model)
    if init_state is not None:
        full.load_state_dict(init_state)
    with torch.device("meta"):
        model = Transformer(cfg.model)
    parallelize(model, meshes, **mixed_precision(cfg), activation_checkpoint=cfg.activation_checkpoint,
                compile=cfg.compile)
    model.to_empty(device=cfg.device)
    # full_state_dict=True: the source holds whole tensors; each rank copies out only its own shard.
    set_model_state_dict(model, full.state_dict(), options=StateDictOptions(full_state_dict=True))
    with torch.no_grad():  # non-persistent buffers are not in a state dict
        # Both models were built from the same class and config, so their buffers come in the same order.
        for (name, b), (_, src) in zip(model.named_buffers(), full.named_buffers()):
            b.copy_(src)
    return model


def reference_copy(model, cfg: TrainConfig, meshes: Meshes | None = None) -> Transformer:
    """A frozen copy of the policy's current weights: the KL penalty's reference model, or the async
    producer's policy. A deep copy of a plain model, or (meshes given) a model parallelized as the
    policy is, each rank copying its own shards (no full tensor is gathered). meshes may be the
    policy's or another set over the same ranks (`build_meshes` again: its own process groups)."""
    import copy
    if meshes is None:
        return copy.deepcopy(model).requires_grad_(False)
    # Rather than deep-copy FSDP's wrappers, hooks and meshes: a second model parallelized the same
    # way has every tensor placed as the policy's is, so each local shard copies into its twin.
    with torch.device("meta"):
        ref = Transformer(cfg.model)
    parallelize(ref, meshes, **mixed_precision(cfg), activation_checkpoint=cfg.activation_checkpoint,
                compile=cfg.compile)
    ref.to_empty(device=cfg.device)
    with torch.no_grad():
        for (name, r), (src_name, p) in zip([*ref.named_parameters(), *ref.named_buffers()],
                                            [*model.named_parameters(), *model.named_buffers()]):
            assert name == src_name, (name, src_name)  # a copy into the wrong twin would pass silently otherwise
            local(r).copy_(local(p))  # equal placements: this rank's shard into its twin, no communication
    return ref.requires_grad_(False)


def load_shards(model, named: dict[str, torch.Tensor]):
    """Copy each tensor's local shard into model's twin of the same name (policy_tensors names, the same
    placements): the async producer taking the trainer's published weights, with no communication. A
    tensor that already is model's own (the engine on the policy itself) is not copied onto itself."""
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            if name in named:  # a tied name appears once in policy_tensors
                dst, src = local(t), local(named[name])
                if dst.data_ptr() != src.data_ptr():
                    dst.copy_(src)


# ----------------------------------------------------------------------------- collectives

class _ThreadGroup(threading.local):
    group = None
    """The process group this thread's collectives run on (`collective_group`'s; None = the default group)."""


_thread = _ThreadGroup()  # every thread starts at the class's None


@contextmanager
def collective_group(group):
    """Run this file's collectives called on this thread on `group`: the async loop's producer thread
    has its own group, so its collectives never interleave with the trainer thread's on one communicator."""
    before = _thread.group
    _thread.group = group
    try:
        yield
    finally:
        _thread.group = before


def all_gather_list(items: list) -> list:
    """Concatenation over ranks (in rank order) of each rank's list of picklable objects."""
    rank, world = rank_world()
    if world == 1:
        return items
    import torch.distributed as dist
    out = [None] * world
    # all_gather_object pickles, so the lists may hold any objects and differ in length by rank.
    dist.all_gather_object(out, items, group=_thread.group)
    return [x for part in out for x in part]  # rank order, so every rank gets the same list


def all_reduce_float(x: float, op: str = "sum") -> float:
    """Sum (or max, or min) of a float over ranks."""
    if rank_world()[1] == 1:
        return x
    import torch.distributed as dist
    # float64 holds a Python float exactly, so only the sum itself rounds. nccl reduces only CUDA
    # tensors (gloo CPU ones), so with nccl the value goes to this rank's GPU, the current device
    # that setup_distributed set.
    group = _thread.group
    t = torch.tensor([x], dtype=torch.float64, device="cuda" if dist.get_backend(group) == "nccl" else "cpu")
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    dist.all_reduce(t, op=ops[op], group=group)
    return t.item()


def barrier():
    """Wait for every rank, on this thread's collective_group (a no-op in one process, where there is no process
    group to wait on)."""
    if rank_world()[1] > 1:
        import torch.distributed as dist
        dist.barrier(group=_thread.group)


def all_ranks(flag: bool) -> bool:
    """True when flag is true on every rank (the sharded engine's stop check: ranks decode in lockstep)."""
    return all_reduce_float(float(flag), "min") > 0


_SETTLED: weakref.WeakSet = weakref.WeakSet()
"""The sharded models whose FSDP root a forward has settled (`gathered` runs one before a model's first phase)."""


@contextmanager
def gathered(model):
    """The sharded policy's weights gathered whole for a rollout phase, freed when the block exits.

    Every FSDP unit is all-gathered once (in its param_dtype: bf16 in a bf16 run, the router gates
    fp32) and stays gathered through every forward of the phase, instead of being gathered and
    freed around each decode step's forward; experts split by expert parallelism stay split, their
    tokens sent by the all-to-all as in training. On exit every unit is resharded and FSDP's records of
    the phase's forwards cleared (`end_phase`), so the trainer finds the model as it left it. A
    collective: every rank of the policy's meshes enters and leaves together. A model without FSDP
    units passes through.
    """
    from torch.distributed.fsdp import FSDPModule
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not units:
        yield model
        return
    if model not in _SETTLED:
        # FSDP2 picks its root at the first forward through the root module; the engine calls blocks through
        # Transformer.hidden, which a fresh model may not yet have run: one token's forward settles it, once
        with torch.no_grad():
            model(torch.zeros(1, 1, dtype=torch.long, device=next(model.parameters()).device))
        _SETTLED.add(model)
    inner = [u for u in units if u is not model]  # the root already keeps its weights gathered after forward
    for u in inner:
        u.set_reshard_after_forward(False, recurse=False)  # gathered until the phase ends, not per forward
    try:
        for u in units:  # module order: the same sequence of all-gathers on every rank
            u.unshard()
        yield model
    finally:
        for u in inner:
            u.set_reshard_after_forward(True, recurse=False)
        end_phase(model, units)


def end_phase(model, units: list) -> None:
    """Reshard every FSDP unit of the root `model` (units: its FSDPModules) and clear what FSDP2 records per
    forward iteration: what torch 2.13's `FSDPModule.reset_iter_state` does after forwards, in calls torch 2.11
    (the lent GPU machine's) has, which lacks that method (tools/torch_api.json lists what it has).

    What a phase of forwards leaves: each unit's post-forward record (the comm context's post_forward_order and
    each group's _post_forward_indices, which the next backward pops to choose what to prefetch: stale ones would
    prefetch the wrong unit), and, where a forward was cut short by an error, units in the FORWARD state (in which
    reshard() is a no-op), the iteration's forward root, and an all-gather not yet waited on. Backward's state
    (reduce-scatters, all-reduces) is not touched: a phase runs no backward. Private fields of FSDP2's state, the
    same in torch 2.11 and 2.13 (tests/test_torch_api.py checks each name against 2.11's wheel).
    """
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
    root = model._get_fsdp_state()
    stream = root._device_handle.current_stream()
    if (pending := root._comm_ctx.all_gather_state) is not None:  # the last all-gather's buffer, kept for reuse
        if pending.event is not None:
            stream.wait_event(pending.event)
        root._comm_ctx.all_gather_state = None
    root._comm_ctx.post_forward_order.clear()
    root._state_ctx.iter_forward_root = None
    for u in units:
        state = u._get_fsdp_state()
        state._training_state = TrainingState.IDLE
        group = state._fsdp_param_group
        if group is not None:
            if (result := group._all_gather_result) is not None:  # an unshard never waited on: wait, then drop
                if result.all_gather_event is not None:
                    stream.wait_event(result.all_gather_event)
                if isinstance(result.all_gather_work, dist.Work):
                    result.all_gather_work.wait()
                group._all_gather_result = None
            group._training_state = TrainingState.IDLE
            group._post_forward_indices.clear()
        u.reshard()


def padded_microbatches(micro: list[list[int]]) -> list[list[int]]:
    """This rank's micro-batches, padded with empty ones to the most any rank has:
    FSDP and the EP all-to-all are collectives, so every rank runs the same number of forwards."""
    most = int(all_reduce_float(float(len(micro)), "max"))
    # An empty micro-batch is the trainer's cue to run idle_forward in its place.
    return micro + [[] for _ in range(most - len(micro))]


def idle_forward(model, cfg: TrainConfig, backward: bool):
    """A one-token forward (and zero-loss backward) that joins the ranks' collectives without data."""
    # Why run it at all: the other ranks' forward all-gathers each block's FSDP shards and sends
    # tokens through the expert all-to-all, and their backward reduce-scatters the gradients. Each
    # of those waits for every rank, so a rank without data must issue the same calls in the same
    # order, or the others block until dist_timeout_s. One token is the smallest input that does.
    logits, _ = model(torch.zeros(1, 1, dtype=torch.long, device=cfg.device))
    if backward:
        # A loss of exactly 0 gives zero gradients: the reductions run, and the sum is unchanged.
        (logits.sum() * 0.0).backward()


# ----------------------------------------------------------------------------- the sharded policy

def checkpoint_and_compile(model: Transformer, *, activation_checkpoint: bool, compile: bool) -> Transformer:
    """Per block, in place: activation checkpointing (its activations recomputed in backward), then
    torch.compile. `parallelize`'s steps 2 and 3; a one-process run takes just these."""
    if activation_checkpoint:
        # torch's wrapper lives under torch.distributed but is plain autograd: it needs no distributed setup
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        for i, block in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(block)
    if compile:
        # after the wrapper (torchtitan's order): the compiled block is the checkpointed one
        for block in model.layers:
            block.compile()
    return model


def parallelize(model: Transformer, meshes: Meshes, *, param_dtype: torch.dtype | None = None,
                reduce_dtype: torch.dtype | None = None, activation_checkpoint: bool = False,
                compile: bool = False) -> Transformer:
    """Shard a (meta-device or materialised) model over `meshes`, in place.

    Order, as torchtitan applies it: 1. expert parallel (meshes.ep): each MoE layer's stacked
    experts become DTensors sharded on the expert dim, and tokens reach them through
    torchtitan's `AllToAllTokenDispatcher`; 2. activation checkpointing per block; 3.
    torch.compile per block; 4. FSDP2 `fully_shard` per block and at the root over
    meshes.fsdp (params gathered in param_dtype, gradients reduced in reduce_dtype; None =
    the parameters' fp32), each router gate apart in fp32 (routing decisions stay in full
    precision), and the experts over meshes.efsdp. Expert gradients sum the tokens of all EP
    ranks, so they are scaled by 1 / ep to stay the data-parallel mean the dense gradients
    are. Where this rank's slice of each sharded parameter starts (what `load_hf` reads) is
    `shard_offsets(model)`'s, read from the parameters themselves.
    Raises ValueError when ep does not divide num_experts.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    moe_blocks = [b for b in model.layers if b.is_moe]
    ep = meshes.ep.size() if meshes.ep is not None else 1
    # 1. expert parallel
    if ep > 1:
        from torch.distributed._functional_collectives import all_to_all_single
        from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher
        if model.cfg.num_experts % ep:
            raise ValueError(f"num_experts={model.cfg.num_experts} must be divisible by ep={ep}")
        for block in moe_blocks:
            experts = block.mlp.experts
            # Shard(0): each rank holds E / ep consecutive experts of w13 and w2
            for name, p in list(experts.named_parameters()):
                experts.register_parameter(name, nn.Parameter(distribute_tensor(p.data, meshes.ep, [Shard(0)])))
            dispatcher = AllToAllTokenDispatcher(AllToAllTokenDispatcher.Config(
                num_experts=model.cfg.num_experts, top_k=model.cfg.top_k))
            dispatcher.wire_meshes(ep_mesh=meshes.ep)
            block.mlp.dispatcher = dispatcher
            # equal splits (None): no split sizes read on the host, for ep_decode.capacity_dispatch's fixed-shape path
            block.mlp.exchange = lambda t, mesh=meshes.ep: all_to_all_single(t, None, None, mesh)
            # the experts' tokens come from all ep ranks of their group: 1 / ep makes the summed gradient
            # the data-parallel mean (FSDP's reduction over efsdp divides by efsdp, no more)
            experts.grad_scale = 1.0 / ep
    # 2. activation checkpointing, 3. torch.compile
    checkpoint_and_compile(model, activation_checkpoint=activation_checkpoint, compile=compile)
    # 4. FSDP2
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    ignored = set()  # EP-only experts (no efsdp mesh): each lives on one rank, outside FSDP
    for block in model.layers:
        inner = getattr(block, "_checkpoint_wrapped_module", block)  # past the checkpoint wrapper
        if inner.is_moe:
            # its own unit, gathered in fp32 whatever param_dtype: a bf16 gate would round the router's scores
            fully_shard(inner.mlp.gate, mesh=meshes.fsdp, mp_policy=fp32)
            if meshes.efsdp is not None:  # the experts (after ep's split, if any) sharded over their own mesh
                fully_shard(inner.mlp.experts, mesh=meshes.efsdp, mp_policy=mp)
            elif ep > 1:
                ignored.update(inner.mlp.experts.parameters())
        # per block, then the root: each block's parameters are gathered just before it runs
        fully_shard(block, mesh=meshes.fsdp, mp_policy=mp, ignored_params=ignored or None)
    fully_shard(model, mesh=meshes.fsdp, mp_policy=mp, ignored_params=ignored or None)
    return model


def shard_offsets(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Each sharded parameter's (a DTensor's, as `parallelize` leaves them) global offset of this rank's slice in
    every dim, by its unwrapped name: where hf.load_hf(offsets=...) starts this rank's read of it. Parameters that
    are no DTensor are left out (they start at 0); a model that is not sharded gives {}."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    return {unwrapped(name): tuple(compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)[1])
            for name, p in model.named_parameters() if isinstance(p, DTensor)}


CHECKPOINT_WRAPPER = "._checkpoint_wrapped_module"  # what activation checkpointing inserts into parameter names


def unwrapped(name: str) -> str:
    """A parameter's name as the unwrapped model has it (state dicts, HF names, engines use these)."""
    return name.replace(CHECKPOINT_WRAPPER, "")
