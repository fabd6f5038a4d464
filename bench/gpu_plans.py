"""bench/gpu.py's configs, sizes and memory plans: computed here, with the project's torch, and carried to the GPU.

The lent GPU machine has torch 2.11, whose memory tracker (FSDPMemTracker, on which plan.trainer_memory reads
its fake training steps) is not the torch the plan is developed and tested with; so the plans the GPU check
compares its readings to are computed here (`python bench/gpu.py --write_plans`, with plan.py as train.py's
dry run uses it: fake tensors on the CPU for a CUDA config, bf16) into bench/gpu_plans.json, which gpu.py
reads on the machine (tests/test_gpu.py checks the file is what the code computes now). Each plan carries
a digest of the config and sizes it is for; gpu.py uses a plan only where the digest is its own run's.

Sections 3-6 run GLM-4.5-Air's widths cut to 3 blocks, the dense first and two MoE. With all 128 routed
experts a training step plans more than an H100's memory (fp32 weights and gradients, AdamW's moments), so
the number of experts per MoE layer is chosen at run time (`choose_cut`): the most of EXPERT_CUTS whose plan,
with its margins and HEADROOM, fits the GPU's free memory.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass

import torch

import plan
from config import TrainConfig, parse_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLANS = os.path.join(ROOT, "bench", "gpu_plans.json")
GiB = 2 ** 30
# GLM-4.5-Air cut to a dense block and two MoE ones (two, so the peak falls where a deep model's does: plan.py's
# choice 3); one process, so ep=1
WIDE_CUT = ["model.n_layers=3", "model.first_k_dense_replace=1", "activation_checkpoint=True", "ep=1", "compile=False"]
# the same layout (sigmoid router, shared expert, partial rotary, qkv bias, GQA) at widths a CPU runs in seconds
TOY_WIDTHS = ["model.vocab_size=512", "model.dim=128", "model.n_heads=8", "model.n_kv_heads=2", "model.head_dim=32",
              "model.num_experts=16", "model.top_k=4", "model.moe_inter_dim=64", "model.dense_inter_dim=256"]
# routed experts per MoE layer, the most first: GLM-4.5-Air's own 128 (an H200's), then what an 80 GB card holds
EXPERT_CUTS = (128, 64, 48, 32)
# the plan has never been checked against a GPU (that is what this check is for): a cut is chosen only with a tenth
# of its planned need to spare, so a plan a little low costs a reading, not the sections' run
HEADROOM = 0.10
# sections 7-9's config: the small recipe, prompts short enough for the engine sections' rows
SMALL = os.path.join("configs", "small.py")
SMALL_ARGS = ["dtype=bfloat16", "max_prompt_tokens=64"]
QUICK_ARGS = ["microbatch_tokens=4096", "gen_batch_rows=256", "sampling.max_new_tokens=16"]  # --quick
SMOKE_ARGS = ["microbatch_tokens=512", "gen_batch_rows=16", "sampling.max_new_tokens=4"]  # --smoke, on tiny.py


@dataclass(frozen=True)
class Shapes:
    """Sections 3-6's sizes: a GPU's (the 100B recipe's lengths) or a CPU's toy ones."""
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


def _config(argv: list[str], device: str) -> TrainConfig:
    # dry_run: a CUDA config built on a machine without CUDA (--write_plans, the tests); gpu.py runs no dry run
    dry = device == "cuda" and not torch.cuda.is_available()
    return parse_args([*argv, f"device={device}", *(["dry_run=True"] if dry else [])])


def small_config(path: str, device: str, *, quick: bool = False, smoke: bool = False) -> TrainConfig:
    """Sections 7-9's config: `path` (configs/small.py) as bench/gpu.py runs it."""
    return _config([path, *SMALL_ARGS, *(SMOKE_ARGS if smoke else QUICK_ARGS if quick else [])], device)


def wide_config(device: str, experts: int | None) -> TrainConfig:
    """Sections 3-6's config: GLM-4.5-Air (configs/100b.py) cut to 3 blocks with `experts` routed experts per MoE
    layer on a GPU, or its layout at toy widths on a CPU (experts None)."""
    shapes = GPU_SHAPES if experts else CPU_SHAPES
    cut = [f"model.num_experts={experts}"] if experts else TOY_WIDTHS
    return _config([os.path.join(ROOT, "configs", "100b.py"), "dtype=bfloat16", *WIDE_CUT,
                    f"microbatch_tokens={shapes.microbatch_tokens}", *cut], device)


def digest(cfg: TrainConfig, shapes: Shapes | None = None) -> str:
    """What a plan is for: the config (but its device and dry_run, which plan.py does not read: it runs its fake
    steps on the CPU whatever the device) and the sections' sizes."""
    fields = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("device", "dry_run")}
    text = json.dumps([fields, dataclasses.asdict(shapes) if shapes else None], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def call_config(cfg: TrainConfig, prompt_tokens: int, new_tokens: int) -> TrainConfig:
    """cfg for one generate call of prompts of prompt_tokens and new_tokens sampled (what plan.generate_peak reads)."""
    return dataclasses.replace(cfg, max_prompt_tokens=prompt_tokens,
                               sampling=dataclasses.replace(cfg.sampling, max_new_tokens=new_tokens))


def wide_plan(cfg: TrainConfig, s: Shapes = GPU_SHAPES) -> dict:
    """Planned bytes of sections 3-6 on the cut cfg: train (plan.trainer_memory's parts of a training step),
    weights (the engine's: the policy gathered in bf16), and the generate peaks beyond them of section 4's phase
    call, section 5's prefill and section 6's decode call."""
    U, T = s.prefill_rows, s.prefill_tokens
    own = plan.engine_bytes(cfg, 1)
    return {"config": digest(cfg, s), "train": plan.trainer_memory(cfg, 1, activation_checkpoint=True),
            "weights": own["dense"] + own["experts"],
            "phase": plan.generate_peak(call_config(cfg, s.phase_prompt_tokens, s.phase_new_tokens), 1,
                                        s.phase_prompts * s.phase_samples, s.phase_prompts),
            "prefill": plan.generate_peak(call_config(cfg, T, 1), 1, U, U),
            "decode": plan.generate_peak(call_config(cfg, T, s.decode_cols - T + 1), 1, U, U)}


def small_plan(cfg: TrainConfig) -> dict:
    """Planned bytes of sections 7's training step and generate calls on cfg."""
    train = plan.trainer_memory(cfg, 1, activation_checkpoint=cfg.activation_checkpoint)
    return {"config": digest(cfg), "train": train, "generate": plan.engine_memory(cfg)["generate"]}


PLAN_SOURCES = ("plan.py", "bench/gpu_plans.py")
"""The files whose code computes the plans: an edit of either makes the carried plans stale (`inputs`)."""


def cuts() -> dict[str, TrainConfig]:
    """The config of each plan bench/gpu.py may read on a GPU: each cut of EXPERT_CUTS, and small.py plain and
    --quick."""
    out = {f"wide_{e}": wide_config("cuda", e) for e in EXPERT_CUTS}
    out["small"] = small_config(os.path.join(ROOT, SMALL), "cuda")
    out["small_quick"] = small_config(os.path.join(ROOT, SMALL), "cuda", quick=True)
    return out


def inputs() -> dict:
    """What the plans are computed from, cheaply: each plan's config digest and a digest of PLAN_SOURCES' code. The
    default tests compare it with the carried file's (a full recompute, about 15 s, is a slow test)."""
    code = hashlib.sha256(b"".join(open(os.path.join(ROOT, f), "rb").read() for f in PLAN_SOURCES)).hexdigest()[:16]
    return {"sources": code, "configs": {name: digest(cfg, GPU_SHAPES if name.startswith("wide") else None)
                                         for name, cfg in cuts().items()}}


def compute_plans() -> dict:
    """Every plan bench/gpu.py may read on a GPU (`cuts`), and the inputs they were computed from."""
    plans = {name: (wide_plan if name.startswith("wide") else small_plan)(cfg) for name, cfg in cuts().items()}
    return {"written_by": "python bench/gpu.py --write_plans", "torch": torch.__version__, "plans": plans,
            "inputs": inputs()}


def write_plans(path: str = PLANS) -> dict:
    got = compute_plans()
    with open(path, "w") as f:
        json.dump(got, f, indent=1, sort_keys=True)
        f.write("\n")
    return got


def read_plans(path: str = PLANS) -> dict:
    """bench/gpu_plans.json: {"torch": the version that computed them, "plans": {name: plan}}; {} where absent."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def wide_need(cfg: TrainConfig, p: dict) -> tuple[int, int]:
    """(peak, need) of a wide plan: the larger of a training step's peak and the rollout phase's (fp32 parameters,
    AdamW, the gathered weights and the largest generate call), and that with plan.with_margins' margins plus what
    this process keeps outside the allocator while section 4's subprocess runs (its context and communicator)."""
    rollout = p["train"]["params"] + p["train"]["optimizer"] + p["weights"] + max(p["phase"], p["prefill"], p["decode"])
    peak = max(p["train"]["total"], rollout)
    return peak, plan.with_margins(cfg, 1, peak) + int((plan.CUDA_CONTEXT_GIB + plan.NCCL_COMMUNICATOR_GIB) * GiB)


def choose_cut(plans: dict, free_bytes: int) -> tuple[int | None, str]:
    """(experts, why): the most routed experts of EXPERT_CUTS whose plan needs, with HEADROOM, at most free_bytes;
    None where none does (sections 3-6 are then skipped) or plans hold no current one."""
    why = []
    for e in EXPERT_CUTS:
        cfg, p = wide_config("cuda", e), plans.get(f"wide_{e}")
        if p is None or p["config"] != digest(cfg, GPU_SHAPES):
            why.append(f"{e} experts: no current plan in bench/gpu_plans.json (run --write_plans)")
            continue
        need = wide_need(cfg, p)[1]
        if need * (1 + HEADROOM) <= free_bytes:
            return e, "; ".join([*why, f"{e} experts: plan {need / GiB:.1f} GiB with margins, +{HEADROOM:.0%} "
                                       f"headroom fits the {free_bytes / GiB:.1f} GiB free"])
        why.append(f"{e} experts: plan {need / GiB:.1f} GiB with margins, +{HEADROOM:.0%} headroom > "
                   f"{free_bytes / GiB:.1f} GiB free")
    return None, "; ".join(why)
