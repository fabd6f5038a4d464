"""Weight sync per RL step: bytes moved per rank and seconds, the replica engine against the sharded one.

What one RL step costs to bring the rollout engine the new weights, on configs/tiny.py's model and
a small one (configs/small.py cut to 2 of its 12 layers: 80M parameters, 94% in routed experts, about
the share of Qwen3-30B-A3B and GLM-4.5-Air), the trainer's weights fp32, the engine's bf16:
1. the replica engine (before issue 17): NativeEngine.update_weights(policy_tensors(model)), a full
   copy into the engine; in one process a local copy, with several ranks also an all-gather of every
   parameter, fp32 (`full_tensor` of each shard), to every rank. Timed in 1 process, and in 2 gloo
   processes (FSDP2 + EP over both, as distributed.build_meshes and build_model make them) both the
   whole update_weights and its all-gather alone.
2. the sharded native engine: no sync (it decodes with the policy's own tensors). What it pays
   instead is the rollout phase's gather of the dense weights: FSDP2 `unshard()` then `reshard()` of
   every FSDP unit (what distributed.gathered does), bf16, the experts staying expert-parallel:
   (world - 1) / world x dense bytes received per rank. Timed in the same 2 processes, interleaved
   with (1)'s, and its gathered bytes checked against plan.engine_bytes.
3. the SGLang push (sglang_engine.py): the whole model leaves in HF names, bucket by bucket, bf16
   or FP8 (weights.quantize_fp8: e4m3 in 128x128 blocks with fp32 scales; the rest bf16). The push
   itself needs SGLang and a GPU; timed here is building the stream (renaming, casting, quantising).
Every timing is interleaved with the others of its group, one warm-up round, then --repeats rounds:
medians with their min-max spread. Then the modelled figure for Qwen3-30B-A3B and GLM-4.5-Air
(configs/100b.py) on 8 GPUs per node: bytes per rank (from the real shapes, plan.engine_bytes) over
NVLink within a node and InfiniBand across nodes, at the links' peak rates (lower bounds), beside
what others measured for the same job (as NeMo-RL and verl reported them; the project's design notes, "Numbers from the field").

    python bench/weight_sync.py [--repeats 5 --models tiny small] [--smoke] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from sampler import Vocab
from bench import smoke  # noqa: E402  (bench/smoke.py)

MODELS = {"tiny": ("tiny.py", []), "small": ("small.py", ["model.n_layers=2"])}
SMOKE = {"repeats": 1, "models": ["tiny"]}  # --smoke: the tiny model's paths (and the modelled rows), one round
# H100/H200 SXM, NVLink 4: 18 links, 900 GB/s per GPU both directions together, 450 GB/s each way
# (NVIDIA H100 Tensor Core GPU datasheet; the H200 datasheet gives the same 900 GB/s)
NVLINK_BYTES_PER_S = 450e9
# InfiniBand NDR: one 400 Gb/s ConnectX-7 port per GPU (NVIDIA DGX H100/H200 user guide: 8 of them for
# the cluster network), 400e9 / 8 = 50 GB/s each way
IB_BYTES_PER_S = 50e9
GPUS_PER_NODE = 8
FIELD = [  # as NeMo-RL and verl reported them (the design notes' "Numbers from the field"): one weight sync of Qwen3-30B-A3B on H100
    ("NeMo-RL, shard to shard, bf16", "0.74-1.0 s"),
    ("NeMo-RL, shard to shard, FP8", "2.9-4.0 s"),
    ("verl, TorchTitan FSDP2 x EP8 engine", "8.07 s"),
]
BF16 = torch.bfloat16


def _cfg(name: str, *extra: str):
    from config import parse_args
    path, overrides = MODELS[name]
    return parse_args([os.path.join(ROOT, "configs", path), *overrides, "dtype=bfloat16", "device=cpu",
                       "activation_checkpoint=False", *extra])


def _stats(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "all": xs}


def _interleaved(fns: dict, repeats: int, sync=None) -> dict:
    """Seconds of each fn, the fns taking turns in every round (a warm-up round first, not kept), so load
    from other jobs hits them alike. sync(seconds) -> seconds: the slowest rank's, in a multi-rank run."""
    times = {name: [] for name in fns}
    for r in range(repeats + 1):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            dt = time.perf_counter() - t
            dt = sync(dt) if sync else dt
            if r:
                times[name].append(dt)
    return {name: _stats(ts) for name, ts in times.items()}


# ----------------------------------------------------------------------------- SGLang's stream

def _stream(model, cfg, fp8: bool):
    """What SGLangEngine.update_weights sends, as (HF name, tensor): bf16, or FP8 targets in e4m3 with fp32
    scales and the rest bf16. The trainer's tensors are fp32: the cast is part of the stream."""
    from hf import hf_tensors
    from weights import FP8, policy_tensors, quantize_fp8
    named = hf_tensors(policy_tensors(model), cfg.model)
    if fp8:
        named = quantize_fp8(named, hf=True)
    for n, t in named:
        yield n, t if t.dtype == FP8 or n.endswith("_scale_inv") else t.to(BF16)


def _push(model, cfg, fp8: bool):
    """Build the stream bucket by bucket, as SGLangEngine._send does before each bucket leaves."""
    from weights import weight_buckets
    for bucket in weight_buckets(_stream(model, cfg, fp8)):
        [t.contiguous() for _, t in bucket]


def push_bytes(model_cfg, fp8: bool) -> int:
    """Bytes of one push from the shapes alone (a meta-device model): every HF tensor in bf16, or the FP8
    targets at 1 byte per value plus one fp32 scale per 128x128 block of their last two dims."""
    from hf import hf_tensors
    from model import Transformer
    from weights import HF_FP8_TARGETS, WEIGHT_BLOCK, policy_tensors
    with torch.device("meta"):
        model = Transformer(model_cfg)
    total = 0
    for name, t in hf_tensors(policy_tensors(model), model_cfg):
        if fp8 and HF_FP8_TARGETS.fullmatch(name):
            R, C = t.shape[-2:]
            total += t.numel() + math.prod(t.shape[:-2]) * -(-R // WEIGHT_BLOCK[0]) * -(-C // WEIGHT_BLOCK[1]) * 4
        else:
            total += t.numel() * 2
    return total


# ----------------------------------------------------------------------------- one process

def measure_one_process(name: str, repeats: int) -> dict:
    """The replica's update_weights and SGLang's stream building, in this process."""
    from model import Transformer
    from rollout import NativeEngine
    from weights import policy_tensors
    cfg = _cfg(name)
    torch.manual_seed(0)
    model = Transformer(cfg.model)  # the trainer's fp32 weights
    engine = NativeEngine(cfg.model, Vocab(-1, 0), dtype=BF16)
    version = iter(range(1, 1 << 30))
    fns = {"replica copy": lambda: engine.update_weights(policy_tensors(model), next(version)),
           "SGLang bf16": lambda: _push(model, cfg, fp8=False),
           "SGLang FP8": lambda: _push(model, cfg, fp8=True)}
    times = _interleaved(fns, repeats)
    stream = {fp8: sum(t.numel() * t.element_size() for _, t in _stream(model, cfg, fp8)) for fp8 in (False, True)}
    assert stream[False] == push_bytes(cfg.model, False) and stream[True] == push_bytes(cfg.model, True)
    engine_bytes = sum(t.numel() * t.element_size() for t in engine.model.state_dict().values())
    return {"times": times, "bytes": {"replica copy": engine_bytes, "SGLang bf16": stream[False],
                                      "SGLang FP8": stream[True]}}


# ----------------------------------------------------------------------------- two processes

def _worker(rank: int, world: int, name: str, repeats: int, port: int, out: str):
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    import distributed
    import plan
    from rollout import NativeEngine
    from weights import full_tensor, policy_tensors
    torch.set_num_threads(1)  # two processes on two cores
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        cfg = _cfg(name, f"ep={world}")
        meshes = distributed.build_meshes(world, cfg.ep)
        torch.manual_seed(0)
        model = distributed.build_model(cfg, meshes)  # FSDP2 (bf16 gathers, fp32 gate), experts split over ep
        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        with torch.no_grad():  # FSDP2 settles its root at the first forward; then every unit back to its shard
            model(torch.zeros(1, 1, dtype=torch.long))
        for u in units:
            u.reshard()
        engine = NativeEngine(cfg.model, Vocab(-1, 0), dtype=BF16)  # the replica of the old path
        version = iter(range(1, 1 << 30))

        def gather():
            for u in units:
                u.unshard()
            for u in units:
                u.reshard()

        def all_gather_each():
            for _, t in policy_tensors(model):
                full_tensor(t)  # each whole tensor dropped at once, as update_weights streams them into the engine

        def slowest(dt: float) -> float:
            t = torch.tensor([dt], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            return t.item()

        fns = {"replica sync": lambda: engine.update_weights(policy_tensors(model), next(version)),
               "replica all-gather": all_gather_each,
               "dense gather": gather}
        times = _interleaved(fns, repeats, sync=slowest)
        # what the rollout phase holds: the gathered dense weights (plain tensors once unsharded) and the buffers
        # (the routers' expert_bias), the experts' local shards (DTensors: EP alone splits them, outside FSDP)
        for u in units:
            u.unshard()
        params = list(model.parameters())
        dense = sum(p.numel() * p.element_size() for p in [*params, *model.buffers()] if not isinstance(p, DTensor))
        experts = sum(p.to_local().numel() * p.element_size() for p in params if isinstance(p, DTensor))
        for u in units:
            u.reshard()
        full_fp32 = sum(t.numel() * 4 for _, t in policy_tensors(engine.model))
        planned = plan.engine_bytes(cfg, world)
        if rank == 0:
            with open(out, "w") as f:
                json.dump({"times": times, "dense": dense, "experts": experts, "planned": planned,
                           "full_fp32": full_fp32}, f)
    finally:
        dist.destroy_process_group()


def measure_two_processes(name: str, repeats: int) -> dict:
    import socket

    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(_worker, args=(2, name, repeats, port, out), nprocs=2)
        with open(out) as f:
            return json.load(f)


# ----------------------------------------------------------------------------- modelled

def modelled(path: str) -> dict:
    """Bytes per rank and seconds at the links' peak rates for one config, on 1 node (NVLink) and 4 nodes (IB)."""
    import plan
    from config import parse_args
    # dry_run: the configs name device='cuda', which a CPU machine refuses for a run; only the shapes are read here
    cfg = parse_args([os.path.join(ROOT, "configs", path), "dtype=bfloat16", "dry_run=True"])
    n = plan.param_counts(cfg.model)["total"]
    rows = {}
    for nodes, link, rate in ((1, "NVLink", NVLINK_BYTES_PER_S), (4, "IB", IB_BYTES_PER_S)):
        world = nodes * GPUS_PER_NODE
        share = (world - 1) / world  # an all-gather: each rank receives every other rank's part
        per_rank = {"sharded: weight sync": 0,
                    "sharded: dense gather": share * plan.engine_bytes(cfg, world)["dense"],
                    "replica: all-gather fp32": share * 4 * n,
                    # one sender's link carries the whole model (a lower bound: the gathers that assemble it
                    # and the engine's load come on top)
                    "SGLang push bf16": push_bytes(cfg.model, False),
                    "SGLang push FP8": push_bytes(cfg.model, True)}
        rows[f"{nodes}x{GPUS_PER_NODE} {link}"] = {k: {"bytes": b, "s": b / rate} for k, b in per_rank.items()}
    return {"params": n, "rows": rows}


# ----------------------------------------------------------------------------- report

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    # one thread: on shared cores a second OpenMP thread that gets descheduled stalls every op at its barrier
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS),
                    help="the models measured; the headline reads the last")
    args = smoke.parse_args(ap, SMOKE)
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    from plan import param_counts
    results = {}
    for name in args.models:
        one, two = measure_one_process(name, args.repeats), measure_two_processes(name, args.repeats)
        n = param_counts(_cfg(name).model)["total"]
        rows = {  # (bytes moved per rank, seconds), per weight sync or per rollout phase
            "replica, 1 process: update_weights (copy)": (one["bytes"]["replica copy"], one["times"]["replica copy"]),
            "replica, 2 ranks: update_weights": (two["full_fp32"] / 2, two["times"]["replica sync"]),
            "replica, 2 ranks: its all-gather alone": (two["full_fp32"] / 2, two["times"]["replica all-gather"]),
            "sharded, 2 ranks: weight sync": (0, None),
            "sharded, 2 ranks: rollout-phase dense gather": (two["dense"] / 2, two["times"]["dense gather"]),
            "SGLang push bf16: build the stream": (one["bytes"]["SGLang bf16"], one["times"]["SGLang bf16"]),
            "SGLang push FP8: quantise the stream": (one["bytes"]["SGLang FP8"], one["times"]["SGLang FP8"]),
        }
        results[name] = {"params": n, "rows": {k: {"bytes": b, "s": t} for k, (b, t) in rows.items()},
                         "gathered_dense_bytes": two["dense"], "expert_shard_bytes": two["experts"],
                         "plan_engine_bytes": two["planned"],
                         "plan_matches": two["planned"]["dense"] == two["dense"]
                         and two["planned"]["experts"] == two["experts"]}
    model = {"qwen3_30b_a3b": modelled("qwen3_30b_a3b.py"), "100b (GLM-4.5-Air)": modelled("100b.py")}
    load = (load_before, os.getloadavg()[0])

    MiB = 2 ** 20
    print(f"measured on this CPU ({os.cpu_count()} cores, torch {torch.__version__}, {args.threads} thread(s); 2 gloo "
          f"processes of 1 thread for the 2-rank rows), trainer fp32, engine bf16; median [min-max] of {args.repeats} "
          f"interleaved rounds")
    print(f"{'model':<7} {'per RL step':<46} {'MiB/rank':>9} {'seconds':>9} {'spread':>17}")
    for name, r in results.items():
        for what, row in r["rows"].items():
            s = row["s"]
            spread = f"[{s['min']:.4f}-{s['max']:.4f}]" if s else ""
            print(f"{name:<7} {what:<46} {row['bytes'] / MiB:>9.2f} {s['median'] if s else 0:>9.4f} {spread:>17}")
        p = r["plan_engine_bytes"]
        print(f"{name:<7} ({r['params'] / 1e6:.1f}M params) gathered dense {r['gathered_dense_bytes']:,} B, expert "
              f"shards {r['expert_shard_bytes']:,} B per rank; plan.engine_bytes: {p['dense']:,} and {p['experts']:,} "
              f"({'equal' if r['plan_matches'] else 'DIFFERENT'})")
    GiB = 2 ** 30
    print(f"\nmodelled per RL step, bytes per rank at the links' peak rates (NVLink 4 "
          f"{NVLINK_BYTES_PER_S / 1e9:.0f} GB/s, IB NDR {IB_BYTES_PER_S / 1e9:.0f} GB/s per GPU each way)")
    print(f"{'model':<20} {'GPUs, link':<12} {'path':<26} {'GiB/rank':>9} {'seconds':>8}")
    for name, m in model.items():
        for where, rows in m["rows"].items():
            for what, row in rows.items():
                print(f"{name:<20} {where:<12} {what:<26} {row['bytes'] / GiB:>9.2f} {row['s']:>8.3f}")
    print("not modelled: the FP8 push's quantisation on the GPU (timed above only on this CPU), the gathers that "
          "assemble whole tensors before a push, the engine's load")
    print("measured by others for Qwen3-30B-A3B on H100 (as NeMo-RL and verl reported them): "
          + "; ".join(f"{who} {s}" for who, s in FIELD))

    last = args.models[-1]
    measured = results[last]["rows"]
    old, new = (measured["replica, 2 ranks: its all-gather alone"],
                measured["sharded, 2 ranks: rollout-phase dense gather"])
    speedup = old["s"]["median"] / new["s"]["median"]
    q = model["qwen3_30b_a3b"]["rows"]
    nv, ib = q[f"1x{GPUS_PER_NODE} NVLink"], q[f"4x{GPUS_PER_NODE} IB"]
    headline = (f"{speedup:.1f}x less time for the sharded engine's rollout-phase gather than the replica's all-gather "
                f"({last}, 2 CPU ranks: {new['s']['median']:.3f} s vs {old['s']['median']:.3f} s; "
                f"{old['bytes'] / new['bytes']:.0f}x fewer bytes), and 0 bytes per weight sync; modelled 30B-A3B dense "
                f"gather {nv['sharded: dense gather']['s']:.3f} s NVLink / {ib['sharded: dense gather']['s']:.3f} s IB "
                f"vs NeMo-RL's measured 0.74 s bf16 sync")
    busy = max(load) > os.cpu_count()
    smoke.write_results(args, "weight_sync", {
        "config": vars(args), "torch_version": torch.__version__, "cpu_count": os.cpu_count(),
        "load_average_1min": load,
        "note": (f"contended: the 1-minute load average ({max(load):.1f}) exceeded the {os.cpu_count()} "
                 f"CPUs; the paths were interleaved, so their ratios are the numbers to read"
                 if busy else "quiet machine"),
        "link_bytes_per_s": {"nvlink": NVLINK_BYTES_PER_S, "ib": IB_BYTES_PER_S},
        "measured": results, "modelled": model, "field": dict(FIELD), "headline": headline,
        "wall_s": time.perf_counter() - t0})
    print(headline)


if __name__ == "__main__":
    main()
