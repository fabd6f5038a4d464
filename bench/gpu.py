"""The GPU check: one command on one H200 that reads what the memory plan assumes and times the GPU path; one table.

Written for a lent machine (torch >= 2.11, transformers, tiktoken; no torchtitan: one GPU; no sglang,
reasoning-gym or math-verify: random prompts and a random init, for the checks are about memory,
kernels, numbers and speed, not learning; nothing fetched). It has not run on a GPU: none has been lent
to this project yet, so neither its numbers nor its run time (meant to stay under 8 minutes) are known.
`--device cpu` runs the same code at toy widths, section 4's subprocess included, and skips the memory
readings (tests/test_gpu.py): a check of the script, not of a number. Sections, in order; each is
guarded (one that raises prints its error in its row and the rest still run), and one that would
start past --budget_s is skipped:

1. Versions: Python, torch, CUDA, cuDNN, NCCL, the GPU and its memory, the driver.
2. Memory outside the caching allocator (torch.cuda.mem_get_info's used less memory_reserved) after
   CUDA init and after a one-rank NCCL group's first collective, beside plan.CUDA_CONTEXT_GIB and
   plan.NCCL_COMMUNICATOR_GIB (one rank has no peers: a lower bound of a communicator's buffers).
3. GLM-4.5-Air's widths (configs/100b.py) cut to 3 blocks, the dense first and 2 MoE, sharded as
   distributed.build_model shards the policy (FSDP2 bf16 mixed precision on the one-rank mesh,
   activation checkpointing): training steps of one 8192-token micro-batch with routes replayed; the
   peak allocated and reserved memory and the GPU's used memory against plan.trainer_memory and
   plan.with_margins; the memory outside the allocator once the kernels are loaded.
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

Results go to --out (bench/results/gpu.json), rewritten after each section, so a run cut short keeps
what it read. Shapes: B, T, S, V, L, K, E (letters of the README's legend).

    timeout 480 python bench/gpu.py [--quick] [--out PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import subprocess
import sys
import time
import traceback
import warnings
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]
import plan  # noqa: E402
import weights  # noqa: E402
from config import EngineConfig, TrainConfig, parse_args  # noqa: E402
from distributed import Meshes, build_model, mixed_precision, parallelize, setup_distributed  # noqa: E402
from espo import mismatch_metrics  # noqa: E402
from mismatch import trainer_logprobs  # noqa: E402  (bench/mismatch.py)
from model import Transformer  # noqa: E402
from rollout import NativeEngine, decode_step  # noqa: E402
from sampler import row_keys  # noqa: E402
from weights import policy_tensors, quantize_fp8  # noqa: E402

GiB = 2 ** 30
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12}  # dense bf16 tensor-core peak, SXM (NVIDIA's datasheets)
BUDGET_S = 360  # no section starts later, so the last ones (7, 8: a minute or two) end within the 8 minutes allowed
SUBPROCESS_TIMEOUT_S = 240  # section 4's second allocator setting (imports, CUDA init, a build, 4 steps), at most
LABEL = 40  # the table's label column
# SDPA without its math kernel, as section 5 runs the prefill. Written here, not taken from model.py's own
# list: the check must not borrow what it checks
NOT_MATH = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
# GLM-4.5-Air cut to a dense block and two MoE ones (two, so the peak falls where a deep model's does: plan.py's
# choice 3); one process, so ep=1
WIDE_CUT = ["model.n_layers=3", "model.first_k_dense_replace=1", "activation_checkpoint=True", "ep=1", "compile=False"]
# the same layout (sigmoid router, shared expert, partial rotary, qkv bias, GQA) at widths a CPU runs in seconds
TOY_WIDTHS = ["model.vocab_size=512", "model.dim=128", "model.n_heads=8", "model.n_kv_heads=2", "model.head_dim=32",
              "model.num_experts=16", "model.top_k=4", "model.moe_inter_dim=64", "model.dense_inter_dim=256"]


@dataclass(frozen=True)
class Shapes:
    """Sections 3-6's sizes: an H200's (the 100B recipe's lengths) or a CPU's toy ones."""
    microbatch_tokens: int  # sections 3-4's training micro-batch (one row)
    train_steps: int  # section 3's: the second holds the AdamW state the first made, as the plan's do
    phase_prompts: int  # section 4's generate call: distinct prompts, samples of each, their lengths
    phase_samples: int
    phase_prompt_tokens: int
    phase_new_tokens: int
    prefill_rows: int  # sections 5-6: distinct prompts, one row each
    prefill_tokens: int
    decode_cols: int  # section 6's cache columns S, and the decode steps timed at its end
    decode_steps: int


GPU_SHAPES = Shapes(microbatch_tokens=8192, train_steps=3, phase_prompts=4, phase_samples=4, phase_prompt_tokens=256,
                    phase_new_tokens=32, prefill_rows=16, prefill_tokens=2048, decode_cols=10240, decode_steps=32)
CPU_SHAPES = Shapes(microbatch_tokens=128, train_steps=2, phase_prompts=2, phase_samples=2, phase_prompt_tokens=16,
                    phase_new_tokens=4, prefill_rows=4, prefill_tokens=64, decode_cols=128, decode_steps=8)
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


@dataclass
class Bench:
    """What the sections share: the arguments, both configs and sizes, the plan's figures (computed before any
    process group: plan.py runs one of its own, fake), the one-rank meshes, and the models built so far."""
    args: argparse.Namespace
    small_cfg: TrainConfig  # sections 7-8's (configs/small.py)
    wide_cfg: TrainConfig  # sections 3-6's (GLM-4.5-Air cut to 3 blocks)
    shapes: Shapes
    plans: dict
    cuda: bool
    deadline: float = float("inf")  # time.perf_counter() past which no section starts
    meshes: Meshes | None = None
    wide: Wide | None = None
    small_model: nn.Module | None = None

    def one_rank(self) -> Meshes:
        """The one-rank process group and mesh (nccl on CUDA, gloo on CPU), made once, as train.py makes them."""
        if self.meshes is None:
            self.meshes = setup_distributed(self.small_cfg)  # one process in bf16: a one-rank group and mesh
        return self.meshes

    def wide_model(self) -> Wide:
        if self.wide is None:
            self.wide = Wide(self.wide_cfg, self.one_rank())
        return self.wide

    def release_wide(self):
        """Free sections 3-6's model, its AdamW state and the allocator's cache (before a second process's turn)."""
        self.wide = None
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def plan(self, name: str):
        """A figure computed at start; RuntimeError with the planner's own error where it failed."""
        if isinstance(self.plans.get(name), Exception):
            raise RuntimeError(f"the plan's {name} failed: {self.plans[name]}")
        return self.plans[name]


def compute_plans(small: TrainConfig, wide: TrainConfig) -> dict:
    """The plan's figures, each an Exception where it failed (reported by the section that reads it)."""
    jobs = {"small_train": lambda: plan.trainer_memory(small, 1, activation_checkpoint=small.activation_checkpoint),
            "small_generate": lambda: plan.engine_memory(small)["generate"],  # the call's: weights are measured apart
            "wide_train": lambda: plan.trainer_memory(wide, 1, activation_checkpoint=True)}
    out = {}
    for name, job in jobs.items():
        try:
            out[name] = job()
        except Exception as e:  # noqa: BLE001  one failed figure fails only the rows that print it
            out[name] = e
    return out


class Report:
    """Runs each section guarded, prints its rows under its title, and rewrites the JSON after each."""

    def __init__(self, path: str, budget_s: float, header: dict):
        self.path, self.budget_s, self.t0 = path, budget_s, time.perf_counter()
        self.out = {**header, "done": False, "sections": {}}

    def run(self, title: str, section, b: Bench, on_error=None) -> dict:
        """section(b) -> (rows [(label, value)], data); its error or a skip becomes its one row. on_error runs after
        an error (sections 3-6: the model is rebuilt, not reused half-way through a step)."""
        start = time.perf_counter()
        print(title, flush=True)
        if start - self.t0 > self.budget_s:
            rows, data = [("skipped", f"out of time: {start - self.t0:.0f} s of the {self.budget_s:.0f} s budget")], {}
        else:
            try:
                rows, data = section(b)
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
        self.out["sections"][section.__name__] = {"title": title, "rows": rows, "seconds": time.perf_counter() - start,
                                                  **data}
        self.save()
        return data

    def save(self):
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self.path, "w") as f:
            json.dump(self.out, f, indent=1, default=str)


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
        self.engine = NativeEngine(m, eos_id=-1, pad_id=0, device=dev, dtype=cfg.compute_dtype(), policy=self.model)
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
    planned = b.plan("wide_train")["total"]
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
    b.release_wide()
    conf = [p for p in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").split(",") if p and "expandable" not in p]
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": ",".join([*conf, f"expandable_segments:{not _expandable()}"])}
    cmd = [sys.executable, os.path.abspath(__file__), "--phases_only", "--device", b.args.device]
    timeout = min(SUBPROCESS_TIMEOUT_S, max(60.0, b.deadline - time.perf_counter()))
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
        call = dataclasses.replace(cfg, max_prompt_tokens=T, sampling=dataclasses.replace(params, max_new_tokens=C))
        planned = plan.generate_peak(call, 1, U, U)  # U rows of U distinct prompts
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
    engine = NativeEngine(cfg.model, eos_id=-1, pad_id=0, device=cfg.device, dtype=torch.bfloat16)  # never stops
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
    train = train_throughput(cfg, model, steps=3 if b.args.quick else 10)
    gen = engine_throughput(cfg, model)
    rows = [("train", f"{train['tokens/s']:,.0f} tokens/s  MFU {train['mfu']:.1%}  micro-batch {train['micro-batch']}"),
            ("engine generate", f"{gen['tokens/s']:,.0f} tokens/s  {gen['rows']} rows x {cfg.sampling.max_new_tokens} "
                                f"new tokens, prompts of {cfg.prompt_limit()}"),
            ("host syncs in a decode step", gen["decode host syncs"])]
    if b.cuda:
        train["planned_bytes"], gen["planned_bytes"] = b.plan("small_train")["total"], b.plan("small_generate")
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
    engines = {"fp8": NativeEngine(cfg.model, eos_id=-1, pad_id=0, device=cfg.device, dtype=torch.bfloat16,
                                       options=EngineConfig(fp8=True)),
               "bf16": NativeEngine(cfg.model, eos_id=-1, pad_id=0, device=cfg.device, dtype=torch.bfloat16)}
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
    mm = mismatch(b.small_cfg, small_model(b), prompts=8 if b.args.quick else 64)
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
    rows = 64 if b.args.quick or not b.cuda else min(cfg.gen_batch_rows, 512)
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
        engine = NativeEngine(cfg.model, eos_id=stops, pad_id=0, device=cfg.device, dtype=torch.bfloat16,
                              options=options)
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

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="sections 7-8: smaller batches and fewer steps")
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "small.py"), help="sections 7-8's config")
    ap.add_argument("--device", default="cuda", help="'cpu' runs the same code at toy widths (the tests' check)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "gpu.json"))
    ap.add_argument("--budget_s", type=float, default=BUDGET_S, help="no section starts after this many seconds")
    ap.add_argument("--phases_only", action="store_true", help=argparse.SUPPRESS)  # section 4's second process
    a = ap.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/gpu.py needs a CUDA GPU (--device cpu only checks that the script runs)")
    if a.device == "cuda" and not a.phases_only:  # as train.main sets it, before CUDA starts; the subprocess's is given
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    quick = ["microbatch_tokens=4096", "gen_batch_rows=256", "sampling.max_new_tokens=16"] if a.quick else []
    small = parse_args([a.config, f"device={a.device}", "dtype=bfloat16", "max_prompt_tokens=64", *quick])
    cuda = a.device == "cuda"
    shapes = GPU_SHAPES if cuda else CPU_SHAPES
    wide = parse_args([os.path.join(ROOT, "configs", "100b.py"), f"device={a.device}", "dtype=bfloat16", *WIDE_CUT,
                       f"microbatch_tokens={shapes.microbatch_tokens}", *([] if cuda else TOY_WIDTHS)])
    torch.backends.cuda.matmul.allow_tf32 = True  # as train.py: the fp32 matmuls left (the router's) on TF32
    torch.manual_seed(0)
    if a.phases_only:  # the last stdout line is what the parent reads
        b = Bench(a, small, wide, shapes, plans={}, cuda=cuda)
        rows, data = phase_rounds(b)
        print(json.dumps({"rows": rows, "data": data}, default=str))
        return
    plans = compute_plans(small, wide)  # first: plan.py's fake process group must not meet the real one
    b = Bench(a, small, wide, shapes, plans=plans, cuda=cuda)
    device = torch.cuda.get_device_name() if cuda else "CPU"
    widths = "GLM-4.5-Air's widths" if cuda else "GLM-4.5-Air's layout at toy widths (CPU)"
    print(f"bench/gpu.py on {device}, torch {torch.__version__}; sections 3-6: {widths}, 3 blocks; sections 7-8: "
          f"{os.path.basename(a.config)} ({plan.param_counts(small.model)['total'] / 1e6:.0f}M params); bf16")
    report = Report(a.out, a.budget_s, {"device": device, "torch": torch.__version__, "quick": a.quick,
                                        "plans": {k: v for k, v in plans.items() if not isinstance(v, Exception)}})
    b.deadline = report.t0 + a.budget_s
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
    report.out.update(done=True, seconds=time.perf_counter() - report.t0)
    ratio = kl.get("kl_ratio_replay_off_over_on", float("nan"))
    report.out["kl_ratio_replay_off_over_on"] = ratio
    report.save()
    sections = report.out["sections"].values()
    failed = [x["title"].split(".")[0] for x in sections if "error" in x]
    skipped = [x["title"].split(".")[0] for x in sections if x["rows"][0][0] == "skipped"]
    print(f"{ratio:.1f}x lower FP8 train-inference KL with router replay (bf16 trainer, random-init "
          f"{os.path.basename(a.config)} model, {device}; {time.perf_counter() - report.t0:.0f} s"
          f"{'; errors in sections ' + ', '.join(failed) if failed else ''}"
          f"{'; out of time: sections ' + ', '.join(skipped) if skipped else ''})")


if __name__ == "__main__":
    main()
