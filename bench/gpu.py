"""The GPU check: one command on the lent GPU that reads what the memory plan assumes and times the GPU path; one table.

Written for the lent machine (one H100 80 GB, sometimes an H200; torch 2.11 with CUDA 13, transformers,
tiktoken; no torchtitan: one GPU needs none; no sglang, reasoning-gym or math-verify: random prompts and a
random init, for the checks are about memory, kernels, numbers and speed, not learning; nothing fetched).
It has not run on a GPU yet, so neither its numbers nor its run time are known. The planned figures come
from bench/gpu_plans.json, computed with the project's torch (`--write_plans`; gpu_plans.py says why).
`--smoke` runs the same code on the CPU at toy widths, section 4's subprocess included, and skips the
memory readings (tests/test_gpu.py, with torchtitan hidden as on the machine): a check of the script, not
of a number. Sections, in order; each is guarded (one that raises prints its error in its row and the
rest still run), one that would start past --budget_s is skipped, and at --end_s a watchdog writes what
was read and ends the run (exit status CUT_SHORT_EXIT):

1. Versions: Python, torch, CUDA, cuDNN, NCCL, the GPU and its memory, the driver.
2. Memory outside the caching allocator (torch.cuda.mem_get_info's used less memory_reserved) after
   CUDA init and after a one-rank NCCL group's first collective, beside plan.CUDA_CONTEXT_GIB and
   plan.NCCL_COMMUNICATOR_GIB (one rank has no peers: a lower bound of a communicator's buffers).
3. GLM-4.5-Air's widths (configs/100b.py) cut to 3 blocks, the dense first and 2 MoE, with as many of its
   128 routed experts per MoE layer as the GPU's free memory holds by the plans (gpu_plans.choose_cut:
   fewer on an 80 GB card; the first line says which and why), sharded as distributed.build_model shards
   the policy (FSDP2 bf16 mixed precision on the one-rank mesh, activation checkpointing): training
   steps of one 8192-token micro-batch with routes replayed; the peak allocated and reserved memory and
   the GPU's used memory against plan.trainer_memory and plan.with_margins; the memory outside the
   allocator once the kernels are loaded.
4. The native engine on that sharded policy (NativeEngine(policy=...), the multi-rank path): rollout
   phases (engine.phase(): weights gathered, generate, freed) alternating with training steps, the
   allocated memory back to its baseline after each, and the reserved memory over the allocated (the
   plan's FRAGMENTATION), with expandable_segments on (train.py's setting) and off (this script
   again in a subprocess: the allocator reads PYTORCH_CUDA_ALLOC_CONF once, at CUDA init).
5. The engine's masked GQA prefill (16 left-padded prompts of up to 2048 tokens, bf16) under
   sdpa_kernel without the math backend; which SDPA op ran, read from torch.profiler.
6. Decoding on the sharded policy over S = 10240 cache columns (a 2048-token prompt and 8192 completion
   tokens fed back, the recipe's lengths), 16 rows: tokens/s at the cache's end, the generate call's
   peak memory against plan.generate_peak, no host sync in a decode step.
7. configs/small.py as train.py runs it: training tokens/s and MFU, the engine's generate tokens/s,
   peak memory against plan.py's, no host sync in a decode step.
8. The train-inference mismatch of FP8 rollouts (blockwise e4m3 through torch._scaled_mm on Hopper)
   against the bf16 trainer, routes replayed (R3) and not, a bf16 engine as the control; the last line
   is the KL ratio. Random init routes near uniformly, so routes flip more often than in a trained
   model (bench/mismatch.py measures a trained one, on CPU).
9. Continuous batching over the paged KV cache (engine.slots, kv_tokens) against static calls of a quarter of
   the rows in the same KV memory, and with the decode step in a CUDA graph (engine.cuda_graph): tokens/s,
   the share of rows whose tokens equal the static engine's, the pool's use and preemptions.

Results go to --out ($OUT/gpu.json where the device tool sets $OUT: only what is written there comes
back from the machine; else bench/results/gpu.json), rewritten after each section, so a run cut short
keeps what it read. Shapes: B, T, S, V, L, K, E (letters of the README's legend).

    timeout 470 python3 bench/gpu.py --out $OUT/gpu.json   # on the lent machine (docs/gpus.md: the GPU check)
    python bench/gpu.py --smoke                            # on a CPU: the script's check
    python bench/gpu.py --write_plans                      # here, after a change to the plan or the configs
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import subprocess
import sys
import threading
import time
import traceback
import warnings
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]
import gpu_plans  # noqa: E402  (bench/gpu_plans.py)
import plan  # noqa: E402
import weights  # noqa: E402
from config import EngineConfig, TrainConfig  # noqa: E402
from distributed import Meshes, build_model, mixed_precision, parallelize, setup_distributed  # noqa: E402
from espo import mismatch_metrics  # noqa: E402
from mismatch import trainer_logprobs  # noqa: E402  (bench/mismatch.py)
from model import Transformer  # noqa: E402
from rollout import NativeEngine, decode_step  # noqa: E402
from sampler import Vocab, row_keys  # noqa: E402
from gpu_plans import CPU_SHAPES, GPU_SHAPES, Shapes  # noqa: E402
from weights import policy_tensors, quantize_fp8  # noqa: E402

GiB = 2 ** 30
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12}  # dense bf16 tensor-core peak, SXM (NVIDIA's datasheets)
# The run's time, inside docs/gpus.md's `timeout 470` (the device tool's command, itself under its 600 s limit):
# no section starts after BUDGET_S, so the last one has END_S - BUDGET_S; at END_S the watchdog writes what was
# read and exits, 20 s before timeout would kill the run with its last reading lost
TIMEOUT_S = 470
END_S = TIMEOUT_S - 20
BUDGET_S = 330
CUT_SHORT_EXIT = 3  # the exit status of a run the watchdog ended (1 is Python's for an error, 2 argparse's)
SUBPROCESS_TIMEOUT_S = 150  # section 4's second allocator setting (imports, CUDA init, a build, 4 steps), at most
SUBPROCESS_END_S = 10  # and it is killed this long before END_S, so the watchdog never leaves it running
LABEL = 40  # the table's label column
# SDPA without its math kernel, as section 5 runs the prefill. Written here, not taken from ops.py's own
# list: the check must not borrow what it checks
NOT_MATH = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
PHASE_ROUNDS = 3  # section 4's rollout phases, each followed by a training step


def _cuda(cfg) -> bool:
    return torch.device(cfg.device).type == "cuda"


def _sync(cfg):
    if _cuda(cfg):
        torch.cuda.synchronize()


def _gib(x: float) -> str:
    return f"{x / GiB:.2f} GiB"


def _ratio(planned: float, measured: float, name: str = "planned") -> str:
    """planned / measured, the form the table prints beside a measurement."""
    return f"{name} {_gib(planned)} ({planned / measured:.2f}x)"


def _outside_allocator() -> int:
    """Bytes the GPU holds outside torch's caching allocator: the CUDA context, loaded kernels, library handles
    and NCCL's buffers (and any other process's memory: a lent machine runs none)."""
    free, total = torch.cuda.mem_get_info()
    return total - free - torch.cuda.memory_reserved()


class Skip(Exception):
    """A section that cannot run here: its one row says why (not an error)."""


@dataclass
class Bench:
    """What the sections share: the arguments, both configs and sizes, the plans read from bench/gpu_plans.json
    (gpu_plans.py), the one-rank meshes, and the models built so far."""
    args: argparse.Namespace
    small_cfg: TrainConfig  # sections 7-9's (configs/small.py)
    wide_cfg: TrainConfig | None  # sections 3-6's (GLM-4.5-Air cut to 3 blocks), None where no cut fits
    cut: str  # which cut sections 3-6 run, and why (or why none)
    shapes: Shapes
    plans: dict  # gpu_plans.read_plans()
    cuda: bool
    end: float = float("inf")  # time.perf_counter() of the watchdog's end (Report.watch)
    meshes: Meshes | None = None
    wide: Wide | None = None
    small_model: nn.Module | None = None

    def one_rank(self) -> Meshes:
        """The one-rank process group and mesh (nccl on CUDA, gloo on CPU), made once, as train.py makes them."""
        if self.meshes is None:
            self.meshes = setup_distributed(self.small_cfg)  # one process in bf16: a one-rank group and mesh
        return self.meshes

    def wide_model(self) -> Wide:
        if self.wide_cfg is None:
            raise Skip(self.cut)
        if self.wide is None:
            self.wide = Wide(self.wide_cfg, self.one_rank())
        return self.wide

    def release_wide(self):
        """Free sections 3-6's model, its AdamW state and the allocator's cache (before a second process's turn)."""
        self.wide = None
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def plan(self, which: str) -> dict:
        """The plan of sections 3-6 ("wide") or 7 ("small") for this run's config and sizes, from
        bench/gpu_plans.json; RuntimeError where it holds none for them (a config changed since --write_plans)."""
        cfg = self.wide_cfg if which == "wide" else self.small_cfg
        shapes = self.shapes if which == "wide" else None
        found = [p for p in self.plans.values() if p["config"] == gpu_plans.digest(cfg, shapes)]
        if not found:
            raise RuntimeError(f"bench/gpu_plans.json has no plan for this run's {which} config: run "
                               f"python bench/gpu.py --write_plans where the project's torch is")
        return found[0]


class Report:
    """Runs each section guarded, prints its rows under its title, and rewrites the JSON after each. A watchdog
    (`watch`) ends the run at a fixed time whatever a section is doing: it writes the JSON, naming the section
    cut short, and exits with CUT_SHORT_EXIT."""

    def __init__(self, path: str, budget_s: float, header: dict):
        self.path, self.budget_s, self.t0 = path, budget_s, time.perf_counter()
        self.out = {**header, "done": False, "sections": {}}
        self.running = "setup"  # the section under way, for the watchdog
        self.lock = threading.Lock()  # the watchdog's thread and the sections' both write the JSON

    def watch(self, end_s: float):
        """At end_s seconds after the start, write what was read, name the section cut short, and exit: a run
        past its `timeout` would be killed with its last section's reading lost and no last line."""
        timer = threading.Timer(max(0.0, end_s - (time.perf_counter() - self.t0)), self._cut_short, args=(end_s,))
        timer.daemon = True  # a run done before end_s exits without waiting for it
        timer.start()

    def _cut_short(self, end_s: float):
        with self.lock:
            self.out["cut_short"] = f"{self.running}: still running at {end_s:.0f} s"
            self._write()
        print(f"cut short at {end_s:.0f} s: {self.running} was still running; {self.path} holds the sections "
              f"before it", flush=True)
        os._exit(CUT_SHORT_EXIT)  # from this thread: the main one may be inside a kernel or a collective

    def run(self, title: str, section, b: Bench, on_error=None) -> dict:
        """section(b) -> (rows [(label, value)], data); its error or a skip becomes its one row. on_error runs after
        an error (sections 3-6: the model is rebuilt, not reused half-way through a step)."""
        start, self.running = time.perf_counter(), title
        print(title, flush=True)
        if start - self.t0 > self.budget_s:
            rows, data = [("skipped", f"out of time: {start - self.t0:.0f} s of the {self.budget_s:.0f} s budget")], {}
        else:
            try:
                rows, data = section(b)
            except Skip as e:
                rows, data = [("skipped", str(e))], {}
            except Exception as e:  # noqa: BLE001  a failed section must not stop the rest
                rows, data = [("error", f"{type(e).__name__}: {(str(e).strip() or '?').splitlines()[0][:160]}")], {
                    "error": traceback.format_exc()}
            if "error" in data:  # out of the except block, whose traceback held the section's tensors: free them
                if on_error is not None:
                    on_error()
                gc.collect()
                if torch.cuda.is_available() and torch.cuda.is_initialized():
                    torch.cuda.empty_cache()
        for label, value in rows:
            print(f"  {label:<{LABEL - 2}} {value}", flush=True)
        with self.lock:
            self.out["sections"][section.__name__] = {"title": title, "rows": rows,
                                                      "seconds": time.perf_counter() - start, **data}
            self._write()
        return data

    def save(self, **fields):
        """Add fields to the JSON's top level and write it."""
        with self.lock:
            self.out.update(fields)
            self._write()

    def _write(self):
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self.path + ".tmp", "w") as f:  # whole or not at all, were the watchdog to exit mid-write
            json.dump(self.out, f, indent=1, default=str)
        os.replace(self.path + ".tmp", self.path)


# ----------------------------------------------------------------------------- 1, 2: the machine

def versions(b: Bench):
    rows = [("python", sys.version.split()[0]), ("torch", torch.__version__)]
    if not b.cuda:
        return rows + [("CUDA, cuDNN, NCCL, GPU", "skipped: needs CUDA")], {}
    p = torch.cuda.get_device_properties(0)
    nccl = torch.cuda.nccl.version()  # a tuple in recent torch, an int in older
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=10).stdout.split("\n")[0].strip() or "n/a"
    except (OSError, subprocess.TimeoutExpired):
        driver = "n/a (no nvidia-smi)"
    rows += [("CUDA (torch's build)", torch.version.cuda), ("cuDNN", str(torch.backends.cudnn.version())),
             ("NCCL", ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)),
             ("GPU", f"{p.name}, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs"),
             ("GPU memory (what torch can allocate)", f"{_gib(p.total_memory)}; plan.GPU_MEMORY_GIB "
              f"{plan.GPU_MEMORY_GIB}"), ("driver", driver)]
    return rows, {"versions": dict(rows)}


def context_and_nccl(b: Bench):
    """The memory the CUDA context and a one-rank NCCL communicator take outside the allocator."""
    import torch.distributed as dist
    if b.cuda:
        torch.cuda.init()
        context = _outside_allocator()  # mem_get_info makes the context if nothing has yet
    meshes = b.one_rank()
    x = torch.ones(1, device=b.small_cfg.device)
    dist.all_reduce(x, group=meshes.fsdp.get_group())  # NCCL makes a communicator at its first collective
    _sync(b.small_cfg)
    if not b.cuda:
        return [("one-rank process group", f"{dist.get_backend()}, all_reduce ok"),
                ("memory outside the allocator", "skipped: needs CUDA")], {}
    nccl = _outside_allocator() - context
    rows = [("CUDA context (outside the allocator)", f"{_gib(context)}  plan.CUDA_CONTEXT_GIB {plan.CUDA_CONTEXT_GIB}"),
            ("one-rank NCCL communicator", f"{_gib(nccl)}  plan.NCCL_COMMUNICATOR_GIB {plan.NCCL_COMMUNICATOR_GIB} "
                                           "(one rank, no peers: a lower bound)")]
    return rows, {"cuda_context_bytes": context, "nccl_one_rank_bytes": nccl}


# ----------------------------------------------------------------------------- 3-6: GLM-4.5-Air's widths

class Wide:
    """GLM-4.5-Air cut to 3 blocks, sharded as the policy (`parallelize` on the one-rank mesh: bf16 gathers, fp32
    master weights, activation checkpointing), the native engine on it, and one micro-batch with its routes."""

    def __init__(self, cfg: TrainConfig, meshes: Meshes):
        self.cfg, m, dev = cfg, cfg.model, cfg.device
        # built on meta and initialised where it lives: distributed.build_model would first draw a full fp32 copy
        # on the CPU (6B parameters, a minute), which buys bitwise parity with a one-process run, not needed here
        with torch.device("meta"):
            self.model = Transformer(m)
        parallelize(self.model, meshes, **mixed_precision(cfg), activation_checkpoint=cfg.activation_checkpoint)
        self.model.to_empty(device=dev)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="DTensor random operators")  # a CPU mesh's, harmless here
            self.model.init_weights()
        self.engine = NativeEngine(m, Vocab(-1, 0), device=dev, dtype=cfg.compute_dtype(), policy=self.model)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=(0.9, 0.95))  # train.rl_optimizer's
        B, T = plan.microbatch_shape(cfg, m.num_experts)
        self.tokens_BT = torch.randint(1, m.vocab_size, (B, T), device=dev)
        # K distinct experts per token and MoE layer, replayed (R3) as the trainer replays the engine's; int32 as
        # in the trainer's batch
        self.routes_BTLK = torch.rand(B, T, m.num_moe_layers, m.num_experts, device=dev).argsort(-1)[
            ..., :m.top_k].int()

    def step(self):
        """One training step on the micro-batch: forward with the chunked logprobs, backward, AdamW."""
        (logp_BT, _), _ = self.model(self.tokens_BT, self.tokens_BT, temperature=self.cfg.sampling.temperature,
                                     routed_experts=self.routes_BTLK)
        (-logp_BT.mean()).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def prompts(self, n: int, tokens: int, pad_step: int = 0) -> list[list[int]]:
        """n random prompts; prompt u is u * pad_step tokens shorter (left-padded by the engine)."""
        return [torch.randint(1, self.cfg.model.vocab_size, (tokens - u * pad_step,)).tolist() for u in range(n)]


def wide_training(b: Bench):
    w, cfg = b.wide_model(), b.wide_cfg
    B, T = w.tokens_BT.shape
    if b.cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(b.shapes.train_steps):
        t = time.perf_counter()
        w.step()
        _sync(cfg)
        times.append(time.perf_counter() - t)
    params = plan.param_counts(cfg.model)["total"]
    rows = [("train step (the last)", f"{times[-1]:.2f} s, {B * T / times[-1]:,.0f} tokens/s, micro-batch {B}x{T}, "
                                      f"{params / 1e6:,.1f}M parameters")]
    data = {"step_seconds": times, "micro-batch": [B, T], "params": params}
    if not b.cuda:
        return rows + [("memory", "skipped: needs CUDA")], data
    planned = b.plan("wide")["train"]["total"]
    alloc, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    free, total = torch.cuda.mem_get_info()
    used, outside = total - free, _outside_allocator()
    margins = plan.with_margins(cfg, 1, planned)  # one rank: the context and fragmentation, no NCCL communicator
    rows += [("peak allocated", f"{_gib(alloc)}  {_ratio(planned, alloc)}"),
             ("peak reserved", f"{_gib(reserved)}  {reserved / alloc - 1:+.1%} over allocated; " + _ratio(
                 planned * (1 + plan.FRAGMENTATION), reserved, f"planned x {1 + plan.FRAGMENTATION} (FRAGMENTATION)")),
             ("GPU used after the steps", f"{_gib(used)}  {_ratio(margins, used, 'plan.with_margins')}"),
             ("outside the allocator, kernels loaded", f"{_gib(outside)}  plan.CUDA_CONTEXT_GIB "
                                                       f"{plan.CUDA_CONTEXT_GIB} (+ the one-rank NCCL communicator)")]
    data.update(peak_allocated=alloc, peak_reserved=reserved, planned=planned, planned_with_margins=margins,
                gpu_used=used, outside_allocator=outside, ratio_allocated=planned / alloc, ratio_used=margins / used)
    return rows, data


def _expandable() -> bool:
    return "expandable_segments:true" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower()


def phase_rounds(b: Bench):
    """Rollout phases on the sharded policy alternating with training steps; allocated bytes against the baseline
    (parameters and AdamW state, between steps) after each, and the peaks."""
    w, s, cuda = b.wide_model(), b.shapes, b.cuda
    if not w.opt.state:  # a run's rollout phase comes after an optimizer step: its AdamW state is held
        w.step()
    prompts = w.prompts(s.phase_prompts, s.phase_prompt_tokens)
    params = dataclasses.replace(b.wide_cfg.sampling, max_new_tokens=s.phase_new_tokens)
    mem = torch.cuda.memory_allocated if cuda else (lambda: 0)
    base, rounds = mem(), []
    for i in range(PHASE_ROUNDS):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        with w.engine.phase():  # gathered, as train.py's rollout stage
            w.engine.generate(prompts, params, n=s.phase_samples, seed=i)
        r = {"after_phase": mem() - base, "phase_peak": torch.cuda.max_memory_allocated() - base if cuda else 0}
        w.step()
        _sync(b.wide_cfg)
        r["after_step"] = mem() - base
        if cuda:
            r.update(round_peak=torch.cuda.max_memory_allocated(), reserved_peak=torch.cuda.max_memory_reserved())
        rounds.append(r)
    if not cuda:  # no allocator setting on a CPU
        return [("phases and steps", f"{PHASE_ROUNDS} of each ran; memory: skipped, needs CUDA")], {"rounds": rounds}
    tag = f"expandable_segments {'on' if _expandable() else 'off'}"
    drift = max(abs(r[k]) for r in rounds for k in ("after_phase", "after_step"))
    back = sum(r["after_phase"] == 0 for r in rounds), sum(r["after_step"] == 0 for r in rounds)
    frag = max(r["reserved_peak"] / r["round_peak"] - 1 for r in rounds)
    rows = [(f"back to baseline, {tag}", f"{'yes' if drift == 0 else 'no'}: {back[0]}/{PHASE_ROUNDS} phases, "
                                         f"{back[1]}/{PHASE_ROUNDS} steps (largest drift {drift:,} B); baseline "
                                         f"{_gib(base)}"),
            (f"peaks, {tag}", f"phase +{_gib(max(r['phase_peak'] for r in rounds))} over the baseline; reserved "
                              f"{frag:+.1%} over allocated (plan.FRAGMENTATION {plan.FRAGMENTATION:.0%})")]
    return rows, {"expandable_segments": _expandable(), "baseline": base, "rounds": rounds, "drift_bytes": drift,
                  "reserved_over_allocated": frag}


def phase_rounds_other_allocator(b: Bench):
    """phase_rounds in a subprocess of this script with expandable_segments switched: the allocator reads its
    settings once, at CUDA init, and this process's GPU memory (the wide model's) is freed first. On a CPU the
    setting means nothing: it runs as a check of the plumbing."""
    if b.wide_cfg is None:
        raise Skip(b.cut)
    b.release_wide()
    conf = [p for p in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").split(",") if p and "expandable" not in p]
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": ",".join([*conf, f"expandable_segments:{not _expandable()}"])}
    experts = ["--experts", str(b.wide_cfg.model.num_experts)] if b.cuda else []  # the same cut
    cmd = [sys.executable, os.path.abspath(__file__), "--phases_only", "--device", b.args.device, *experts]
    timeout = min(SUBPROCESS_TIMEOUT_S, b.end - SUBPROCESS_END_S - time.perf_counter())
    if timeout < 30:  # imports and CUDA init alone take about that
        raise Skip(f"out of time: {timeout:.0f} s left for the subprocess before the watchdog")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if out.returncode:
        raise RuntimeError(f"the subprocess exited {out.returncode}: {out.stderr.strip()[-600:]}")
    if not out.stdout.strip():
        raise RuntimeError(f"the subprocess printed nothing: {out.stderr.strip()[-600:]}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    return [tuple(r) for r in got["rows"]], got["data"]


def prefill_attention(b: Bench):
    """The engine's prefill (its own _prefill: the model's forward with the left-padding mask) under sdpa_kernel
    without the math backend, profiled for the SDPA op that ran."""
    from torch.profiler import ProfilerActivity, profile
    w, s, m = b.wide_model(), b.shapes, b.wide_cfg.model
    U, T = s.prefill_rows, s.prefill_tokens
    prompts = w.prompts(U, T, pad_step=T // (2 * U))  # left padding 0 .. (U - 1) T / 2U: a mask, not just causal
    with w.engine.phase(), sdpa_kernel(NOT_MATH), profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        w.engine._prefill(prompts, 1, 1)
        _sync(b.wide_cfg)
        seconds = time.perf_counter() - t
    # the public entry point dispatches to one of its kernels' ops, named after the backend
    ops = sorted({e.key.removeprefix("aten::") for e in prof.key_averages()
                  if "scaled_dot_product" in e.key and e.key != "aten::scaled_dot_product_attention"})
    math = [op for op in ops if "math" in op]
    rows = [(f"{U} rows x {T} tokens, H={m.n_heads} J={m.n_kv_heads}", f"{', '.join(ops) or 'no SDPA op seen'}; "
                                                                        f"{seconds:.2f} s profiled"),
            ("math kernel", f"ran: {', '.join(math)}" if math else "not run")]
    return rows, {"sdpa_ops": ops, "math_ran": bool(math), "seconds": seconds}


def long_decode(b: Bench):
    """Decode steps at the end of an S-column cache (the attention reads every column), 16 rows, through the
    engine's own _prefill and _decode on the sharded policy; the call's peak memory; a host-sync check."""
    w, s, cfg = b.wide_model(), b.shapes, b.wide_cfg
    U, T, S, steps = s.prefill_rows, s.prefill_tokens, s.decode_cols, s.decode_steps
    C = S - T + 1  # a generate call of C new tokens has S = T + C - 1 columns
    params = dataclasses.replace(cfg.sampling, max_new_tokens=steps + 1)  # steps decode steps, then one last sample
    keys_B = row_keys(0, list(range(U)), [0] * U, cfg.device)
    prompts, e = w.prompts(U, T), w.engine
    with e.phase():
        before = torch.cuda.memory_allocated() if b.cuda else 0
        if b.cuda:
            torch.cuda.reset_peak_memory_stats()
        last_BV, state, _ = e._prefill(prompts, 1, C)
        e._decode(last_BV.clone(), state, keys_B, dataclasses.replace(params, max_new_tokens=3), S - steps - 3)  # warm
        _sync(cfg)
        t = time.perf_counter()
        e._decode(last_BV.clone(), state, keys_B, params, S - steps)  # columns S - steps .. S - 1
        _sync(cfg)
        seconds = time.perf_counter() - t
        peak = torch.cuda.max_memory_allocated() - before if b.cuda else float("nan")
        syncs = "not checked (CPU)"
        if b.cuda:  # a decode step must not wait on the host: one with CUDA's sync check set to raise
            torch.cuda.set_sync_debug_mode("error")
            try:
                decode_step(e.model, last_BV.argmax(-1), state, S - 1)
                syncs = "none"
            except RuntimeError as err:
                syncs = f"yes: {str(err).splitlines()[0][:80]}"
            finally:
                torch.cuda.set_sync_debug_mode("default")
    rows = [(f"{U} rows, S={S} columns", f"{U * steps / seconds:,.0f} tokens/s, {seconds / steps * 1e3:.1f} ms a step "
                                         f"(the last {steps} columns)"),
            ("host syncs in a sharded decode step", syncs)]
    data = {"tokens/s": U * steps / seconds, "step_ms": seconds / steps * 1e3, "decode host syncs": syncs}
    if b.cuda:
        planned = b.plan("wide")["decode"]  # plan.generate_peak of U rows of U distinct prompts, S columns
        rows.insert(1, ("generate call peak memory", f"{_gib(peak)}  {_ratio(planned, peak)}"))
        data.update(peak_bytes=peak, planned_bytes=planned, ratio=planned / peak)
    return rows, data


# ----------------------------------------------------------------------------- 7, 8: configs/small.py

def small_model(b: Bench) -> nn.Module:
    if b.small_model is None:
        torch.manual_seed(0)
        b.small_model = build_model(b.small_cfg, b.one_rank())  # bf16 through FSDP2 mixed precision, as train.py
    return b.small_model


def train_throughput(cfg, model, steps: int) -> dict:
    """Tokens/s, MFU and peak memory of full training steps on one micro-batch of random tokens."""
    B, T = plan.microbatch_shape(cfg, cfg.model.num_experts)
    tokens = torch.randint(cfg.model.vocab_size, (B, T), device=cfg.device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95))  # train.rl_optimizer's

    def step():
        (logp, _), _ = model(tokens, tokens, temperature=cfg.sampling.temperature)
        (-logp.mean()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    if _cuda(cfg):
        torch.cuda.reset_peak_memory_stats()
    for _ in range(2):  # warm-up: kernels chosen, AdamW state made
        step()
    _sync(cfg)
    t = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(cfg)
    tok_s = B * T * steps / (time.perf_counter() - t)
    counts = plan.param_counts(cfg.model)
    m = cfg.model
    # model FLOPs per token (PaLM appendix B): 6 x the matmul weights a token uses (not the embedding lookup)
    # + 6 x attention's two score matmuls, 2 x n_layers x T x heads x head_dim, halved for the causal mask
    flops = 6 * (counts["active"] - m.vocab_size * m.dim) + 6 * m.n_layers * T * m.n_heads * m.head_dim
    peak = next((v for k, v in PEAK_BF16_FLOPS.items() if _cuda(cfg) and k in torch.cuda.get_device_name()), None)
    return {"tokens/s": tok_s, "mfu": flops * tok_s / peak if peak else float("nan"), "micro-batch": f"{B}x{T}",
            "peak_bytes": torch.cuda.max_memory_allocated() if _cuda(cfg) else float("nan")}


def engine_throughput(cfg, model) -> dict:
    """Generate tokens/s of gen_batch_rows rows and the memory the call adds at its peak."""
    engine = NativeEngine(cfg.model, Vocab(-1, 0), device=cfg.device, dtype=torch.bfloat16)  # never stops
    engine.update_weights(policy_tensors(model), version=1)
    U, P = cfg.gen_batch_rows // cfg.group_size, cfg.prompt_limit()
    prompts = torch.randint(cfg.model.vocab_size, (U, P)).tolist()
    params = cfg.sampling  # the run's: max_new_tokens, temperature, top_p, top_k
    engine.generate(prompts[:2], params, n=cfg.group_size, seed=0)  # warm-up
    _sync(cfg)
    if _cuda(cfg):
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    engine.generate(prompts, params, n=cfg.group_size, seed=0)
    _sync(cfg)
    seconds = time.perf_counter() - t
    out = {"tokens/s": cfg.gen_batch_rows * cfg.sampling.max_new_tokens / seconds, "rows": cfg.gen_batch_rows,
           "peak_bytes": torch.cuda.max_memory_allocated() - before if _cuda(cfg) else float("nan"),
           "decode host syncs": "not checked (CPU)"}
    if _cuda(cfg):  # a decode step must not wait on the host: run one with CUDA's sync check set to raise
        last_BV, state, _ = engine._prefill(prompts[:4], 2, 4)
        torch.cuda.set_sync_debug_mode("error")
        try:
            decode_step(engine.model, last_BV.argmax(-1), state, P)
            out["decode host syncs"] = "none"
        except RuntimeError as e:
            out["decode host syncs"] = f"yes: {str(e).splitlines()[0][:60]}"
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return out


def small_throughput(b: Bench):
    cfg, model = b.small_cfg, small_model(b)
    train = train_throughput(cfg, model, steps=1 if b.args.smoke else 3 if b.args.quick else 10)
    gen = engine_throughput(cfg, model)
    rows = [("train", f"{train['tokens/s']:,.0f} tokens/s  MFU {train['mfu']:.1%}  micro-batch {train['micro-batch']}"),
            ("engine generate", f"{gen['tokens/s']:,.0f} tokens/s  {gen['rows']} rows x {cfg.sampling.max_new_tokens} "
                                f"new tokens, prompts of {cfg.prompt_limit()}"),
            ("host syncs in a decode step", gen["decode host syncs"])]
    if b.cuda:
        planned = b.plan("small")
        train["planned_bytes"], gen["planned_bytes"] = planned["train"]["total"], planned["generate"]
        rows.insert(1, ("train peak memory", f"{_gib(train['peak_bytes'])}  "
                                             f"{_ratio(train['planned_bytes'], train['peak_bytes'])}"))
        rows.insert(3, ("engine generate peak memory", f"{_gib(gen['peak_bytes'])}  "
                                                       f"{_ratio(gen['planned_bytes'], gen['peak_bytes'])}"))
        train["ratio"], gen["ratio"] = (x["planned_bytes"] / x["peak_bytes"] for x in (train, gen))
    else:
        rows.insert(1, ("peak memory", "skipped: needs CUDA"))
    return rows, {"train": train, "engine": gen}


def mismatch(cfg, model, prompts: int) -> dict:
    """KL etc. of FP8 and bf16 engine rollouts against the bf16 trainer, routes replayed and not."""
    engines = {"fp8": NativeEngine(cfg.model, Vocab(-1, 0), device=cfg.device, dtype=torch.bfloat16,
                                   options=EngineConfig(fp8=True)),
               "bf16": NativeEngine(cfg.model, Vocab(-1, 0), device=cfg.device, dtype=torch.bfloat16)}
    engines["fp8"].update_weights(quantize_fp8(policy_tensors(model)), version=1)  # quantised on the trainer side
    engines["bf16"].update_weights(policy_tensors(model), version=1)
    ids = torch.randint(cfg.model.vocab_size, (prompts, 64)).tolist()
    params = cfg.sampling
    rows = {}
    for name, engine in engines.items():
        rollouts = engine.generate(ids, params, n=cfg.group_size, seed=1)
        for replay in (False, True):
            got = trainer_logprobs(model, rollouts, replay=replay, temperature=cfg.sampling.temperature)
            rows[f"{name} engine, replay {'on' if replay else 'off'}"] = mismatch_metrics(
                [r.logprobs for r in rollouts], [lp for lp, _ in got],
                infer_routes=[r.routes for r in rollouts], trainer_routes=[own for _, own in got])
    hopper = _cuda(cfg) and torch.cuda.get_device_capability() == (9, 0)
    rows["scaled_mm"] = "torch._scaled_mm" if hopper and not weights._scaled_mm_broken else "fallback (dequantised)"
    return rows


def fp8_mismatch(b: Bench):
    mm = mismatch(b.small_cfg, small_model(b), prompts=2 if b.args.smoke else 8 if b.args.quick else 64)
    rows = [("FP8 matmuls", mm["scaled_mm"]),
            ("rollouts vs bf16 trainer", f"{'KL':>9} {'max|dlogp|':>11} {'routes differ':>14}")]
    for name in (f"{e} engine, replay {r}" for e in ("fp8", "bf16") for r in ("off", "on")):
        m = mm[name]
        rows.append((name, f"{m['mismatch/kl']:>9.2e} {m['mismatch/max_abs_logp']:>11.2e} "
                           f"{m['mismatch/route_diff']:>14.4f}"))
    ratio = mm["fp8 engine, replay off"]["mismatch/kl"] / max(mm["fp8 engine, replay on"]["mismatch/kl"], 1e-30)
    return rows, {"mismatch": mm, "kl_ratio_replay_off_over_on": ratio}


def continuous_paged(b: Bench):
    """Continuous batching over the paged KV cache against static calls of gen_batch_rows rows, the same rows and
    seeds; on CUDA also with the decode step in a CUDA graph (engine.cuda_graph). Rows stop at random (stop ids),
    so lengths are long-tailed; tokens equal to the static engine's (share of rows), tokens/s and the pool's use."""
    cfg, model = b.small_cfg, small_model(b)
    rows = 16 if b.args.smoke else 64 if b.args.quick or not b.cuda else min(cfg.gen_batch_rows, 512)
    stops = list(range(1, 1 + max(1, cfg.model.vocab_size // 200)))  # about 1 in 200 per token: a long tail
    prompts = torch.randint(len(stops) + 1, cfg.model.vocab_size, (rows // cfg.group_size, 32)).tolist()
    C = min(cfg.sampling.max_new_tokens, 256)
    params = dataclasses.replace(cfg.sampling, max_new_tokens=C)
    static_kv = rows // 4 * (32 + C - 1)  # a static call of a quarter of the rows: the paged engines' KV memory
    ways = {"static": EngineConfig(), "paged": EngineConfig(slots=rows // 2, kv_tokens=static_kv)}
    if b.cuda:
        ways["paged + CUDA graph"] = EngineConfig(slots=rows // 2, kv_tokens=static_kv, cuda_graph=True)
    out, table, reference = {}, [], None
    for name, options in ways.items():
        engine = NativeEngine(cfg.model, Vocab(stops, 0), device=cfg.device, dtype=torch.bfloat16, options=options)
        engine.update_weights(policy_tensors(model), version=1)
        engine.generate(prompts[:1], params, n=2, seed=1)  # warm-up
        _sync(cfg)
        t = time.perf_counter()
        if name == "static":  # calls of a quarter of the rows, each prompt keeping its group id (its index)
            k, got = max(1, rows // 4 // cfg.group_size), []
            for i in range(0, len(prompts), k):
                got += engine.generate(prompts[i:i + k], params, n=cfg.group_size, seed=0,
                                       group_ids=list(range(i, min(i + k, len(prompts)))))
        else:
            got = engine.generate(prompts, params, n=cfg.group_size, seed=0)
        _sync(cfg)
        seconds = time.perf_counter() - t
        ids = [r.completion_ids for r in got]
        reference = reference or ids
        tokens = sum(map(len, ids))
        same = sum(a == c for a, c in zip(ids, reference)) / len(ids)
        out[name] = {"tokens/s": tokens / seconds, "tokens": tokens, "same_tokens": same, "kv_bytes": engine.kv_bytes,
                     "kv_live_bytes": engine.kv_live_bytes, "preemptions": engine.preemptions}
        table.append((name, f"{tokens / seconds:>9,.0f} tokens/s  same tokens {out[name]['same_tokens']:.0%} of rows  "
                            f"KV {_gib(engine.kv_bytes)} (rows held {_gib(engine.kv_live_bytes)}), "
                            f"{engine.preemptions} preempted"))
    return table, out


# ----------------------------------------------------------------------------- the run

def default_out(smoke: bool) -> str:
    """$OUT/gpu.json where the device tool's $OUT is set (what a command writes there comes back; the working copy
    does not), else bench/results/gpu.json, or with --smoke gpu.smoke.json beside it (bench/smoke.py's scheme: a
    smoke run never lands on the measured numbers)."""
    if os.environ.get("OUT"):
        return os.path.join(os.environ["OUT"], "gpu.smoke.json" if smoke else "gpu.json")
    return os.path.join(ROOT, "bench", "results", "gpu.smoke.json" if smoke else "gpu.json")


def choose(a: argparse.Namespace, plans: dict) -> tuple[TrainConfig | None, str]:
    """Sections 3-6's config and why: on a GPU the cut gpu_plans.choose_cut picks for its free memory (or the
    --experts given); on a CPU the toy widths, with the cut each GPU of plan.GPU_MEMORY_GIB would get."""
    if a.device != "cuda":
        cards = "; ".join(f"{name}: {gpu_plans.choose_cut(plans, int((gib - plan.CUDA_CONTEXT_GIB) * GiB))[0]}"
                          for name, gib in plan.GPU_MEMORY_GIB.items())
        return gpu_plans.wide_config(a.device, None), f"CPU: toy widths (a GPU's experts from the plans: {cards})"
    if a.experts:
        return gpu_plans.wide_config(a.device, a.experts), f"{a.experts} experts (--experts)"
    free = torch.cuda.mem_get_info()[0]  # after this process's CUDA context: what the sections can have
    experts, why = gpu_plans.choose_cut(plans, free)
    return (gpu_plans.wide_config(a.device, experts) if experts else None), why


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="sections 7-9: smaller batches and fewer steps")
    ap.add_argument("--smoke", action="store_true",
                    help="the tests' check of the script: --device cpu --quick on configs/tiny.py, smaller still")
    ap.add_argument("--config", default=os.path.join(ROOT, gpu_plans.SMALL), help="sections 7-9's config")
    ap.add_argument("--device", default="cuda", help="'cpu' runs the same code at toy widths")
    ap.add_argument("--out", default="", help="the JSON (default: $OUT/gpu.json, else bench/results/gpu.json; "
                                              "gpu.smoke.json with --smoke)")
    ap.add_argument("--budget_s", type=float, default=BUDGET_S, help="no section starts after this many seconds")
    ap.add_argument("--end_s", type=float, default=END_S, help="the watchdog: the run ends at this many seconds")
    ap.add_argument("--write_plans", action="store_true", help=f"compute the plans into {gpu_plans.PLANS} (with "
                                                                "this machine's torch: the project's, not the GPU's)")
    ap.add_argument("--experts", type=int, default=0, choices=[0, *gpu_plans.EXPERT_CUTS],
                    help="sections 3-6's routed experts (0: the most the plans fit in free memory)")
    ap.add_argument("--phases_only", action="store_true", help=argparse.SUPPRESS)  # section 4's second process
    a = ap.parse_args()
    if a.write_plans:
        got = gpu_plans.write_plans()
        print(f"wrote {gpu_plans.PLANS}: {', '.join(got['plans'])} (torch {got['torch']})")
        return
    a.out = a.out or default_out(a.smoke)
    if a.smoke:
        a.device, a.quick, a.config = "cpu", True, os.path.join(ROOT, "configs", "tiny.py")
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/gpu.py needs a CUDA GPU (--smoke only checks that the script runs)")
    if a.device == "cuda" and not a.phases_only:  # as train.main sets it, before CUDA starts; the subprocess's is given
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    cuda = a.device == "cuda"
    small = gpu_plans.small_config(a.config, a.device, quick=a.quick, smoke=a.smoke)
    shapes = GPU_SHAPES if cuda else CPU_SHAPES
    written = gpu_plans.read_plans()  # {} where the file is absent: every planned figure's row then says so
    plans = written.get("plans", {})
    torch.backends.cuda.matmul.allow_tf32 = True  # as train.py: the fp32 matmuls left (the router's) on TF32
    torch.manual_seed(0)
    wide, cut = choose(a, plans)
    if a.phases_only:  # the last stdout line is what the parent reads
        b = Bench(a, small, wide, cut, shapes, plans=plans, cuda=cuda)
        rows, data = phase_rounds(b)
        print(json.dumps({"rows": rows, "data": data}, default=str))
        return
    b = Bench(a, small, wide, cut, shapes, plans=plans, cuda=cuda)
    device = torch.cuda.get_device_name() if cuda else "CPU"
    blocks = f"GLM-4.5-Air, 3 blocks, {wide.model.num_experts} experts" if wide else "skipped"
    print(f"bench/gpu.py on {device}, torch {torch.__version__}; sections 3-6: {f'{blocks} ({cut})' if cuda else cut}"
          f"; sections 7-9: {os.path.basename(a.config)} ({plan.param_counts(small.model)['total'] / 1e6:.0f}M "
          f"params); bf16; writing {a.out}", flush=True)
    report = Report(a.out, a.budget_s, {"device": device, "torch": torch.__version__, "quick": a.quick,
                                        "smoke": a.smoke, "cut": cut, "plans_torch": written.get("torch"),
                                        "experts": wide.model.num_experts if wide else None})
    report.watch(a.end_s)
    b.end = report.t0 + a.end_s
    report.run("1. versions", versions, b)
    report.run("2. memory outside the allocator: CUDA context, NCCL", context_and_nccl, b)
    report.run("3. 3 GLM-4.5-Air blocks (1 dense, 2 MoE): training, activation checkpointing, routes replayed",
               wide_training, b, b.release_wide)
    report.run("4. rollout phases on the sharded policy alternating with training steps", phase_rounds, b,
               b.release_wide)
    report.run("4. the same, the other expandable_segments setting (a subprocess)", phase_rounds_other_allocator, b)
    report.run("5. the engine's masked GQA prefill, math kernel excluded", prefill_attention, b, b.release_wide)
    report.run(f"6. decoding {shapes.prefill_rows} rows over S={shapes.decode_cols} cache columns", long_decode, b,
               b.release_wide)
    b.release_wide()
    report.run(f"7. {os.path.basename(a.config)}: training and generation", small_throughput, b)
    kl = report.run("8. FP8 vs bf16 rollouts against the bf16 trainer", fp8_mismatch, b)
    report.run("9. continuous batching over pages (and in a CUDA graph) vs static calls", continuous_paged, b)
    ratio = kl.get("kl_ratio_replay_off_over_on", float("nan"))
    report.save(done=True, seconds=time.perf_counter() - report.t0, kl_ratio_replay_off_over_on=ratio)
    sections = report.out["sections"].values()
    failed = [x["title"].split(".")[0] for x in sections if "error" in x]
    skipped = [x["title"].split(".")[0] for x in sections if x["rows"][0][0] == "skipped"]
    print(f"{ratio:.1f}x lower FP8 train-inference KL with router replay (bf16 trainer, random-init "
          f"{os.path.basename(a.config)} model, {device}; {time.perf_counter() - report.t0:.0f} s"
          f"{'; errors in sections ' + ', '.join(failed) if failed else ''}"
          f"{'; skipped: sections ' + ', '.join(skipped) if skipped else ''})")


if __name__ == "__main__":
    main()
