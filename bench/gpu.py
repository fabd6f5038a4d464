"""The GPU check: configs/small.py's model in bf16 on one GPU, measured as train.py runs it; one table.

Rows: training tokens/s and MFU (the policy as build_model makes it in bf16: FSDP2 mixed
precision on a one-rank mesh, a full micro-batch of microbatch_tokens, forward with the chunked
logprobs, backward, AdamW); the engine's generate tokens/s (NativeEngine in bf16, gen_batch_rows
rows); peak GPU memory (torch.cuda.max_memory_allocated) against plan.py's; that a decode step
makes no host sync (torch.cuda.set_sync_debug_mode); and the train-inference mismatch of FP8
rollouts (blockwise e4m3 weights through torch._scaled_mm on Hopper) against the bf16 trainer,
routes replayed (R3) and not, with a bf16 engine as the control. Ends with the KL ratio.

Needs CUDA; FP8's _scaled_mm path needs Hopper (H100/H200), elsewhere it reports the fallback.
Runs on what the lent GPU machine has (torch >= 2.11, transformers, tiktoken): no torchtitan (one
GPU), no reasoning-gym (random prompts: the check is about numbers and speed, not learning),
nothing fetched. The weights are a random init, so routing is near uniform and routes flip more
often than in a trained model (bench/mismatch.py measures a trained one, on CPU).
Not run on this repository's CPU machine: GPU-only, and labelled so in the README.

    python bench/gpu.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]
import plan  # noqa: E402
import weights  # noqa: E402
from config import parse_args  # noqa: E402
from distributed import build_model, setup_distributed  # noqa: E402
from espo import mismatch_metrics  # noqa: E402
from mismatch import trainer_logprobs  # noqa: E402  (bench/mismatch.py)
from rollout import NativeEngine, decode_step  # noqa: E402
from weights import policy_tensors, quantize_fp8  # noqa: E402

PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12}  # dense bf16 tensor-core peak, SXM (NVIDIA's datasheets)


def _cuda(cfg) -> bool:
    return torch.device(cfg.device).type == "cuda"


def _sync(cfg):
    if _cuda(cfg):
        torch.cuda.synchronize()


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


def mismatch(cfg, model, prompts: int) -> dict:
    """KL etc. of FP8 and bf16 engine rollouts against the bf16 trainer, routes replayed and not."""
    engines = {"fp8": NativeEngine(cfg.model, eos_id=-1, pad_id=0, device=cfg.device, dtype=torch.bfloat16, fp8=True),
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller batches and fewer steps")
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "small.py"))
    ap.add_argument("--device", default="cuda", help="'cpu' runs the same code for a check of the script (tests)")
    a = ap.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/gpu.py needs a CUDA GPU (--device cpu only checks that the script runs)")
    quick = ["microbatch_tokens=4096", "gen_batch_rows=256", "sampling.max_new_tokens=16"] if a.quick else []
    cfg = parse_args([a.config, f"device={a.device}", "dtype=bfloat16", "max_prompt_tokens=64", *quick])
    # the plan first: it runs in a fake process group of its own, which must not meet the real one
    planned = {"train": plan.trainer_memory(cfg, 1, activation_checkpoint=cfg.activation_checkpoint)["total"],
               "generate": plan.engine_memory(cfg)["generate"]}  # the call's part: the weights are measured apart
    torch.backends.cuda.matmul.allow_tf32 = True  # as train.py: the fp32 matmuls left (the router's) on TF32
    torch.manual_seed(0)
    meshes = setup_distributed(cfg)  # a one-rank process group: bf16 through FSDP2 mixed precision, as train.py
    model = build_model(cfg, meshes)
    t0 = time.perf_counter()
    train = train_throughput(cfg, model, steps=3 if a.quick else 10)
    gen = engine_throughput(cfg, model)
    train["planned_bytes"], gen["planned_bytes"] = planned["train"], planned["generate"]
    mm = mismatch(cfg, model, prompts=8 if a.quick else 64)
    GiB = 2 ** 30
    device = torch.cuda.get_device_name() if _cuda(cfg) else "CPU"
    print(f"{device}, torch {torch.__version__}; {os.path.basename(a.config)} "
          f"({plan.param_counts(cfg.model)['total'] / 1e6:.0f}M params) in bf16; {time.perf_counter() - t0:.0f} s")
    print(f"{'train':<34} {train['tokens/s']:>12,.0f} tokens/s  MFU {train['mfu']:.1%}  micro-batch {train['micro-batch']}")
    print(f"{'train peak memory':<34} {train['peak_bytes'] / GiB:>12.2f} GiB  planned {train['planned_bytes'] / GiB:.2f} "
          f"GiB ({train['planned_bytes'] / train['peak_bytes']:.2f}x)")
    print(f"{'engine generate':<34} {gen['tokens/s']:>12,.0f} tokens/s  {gen['rows']} rows x {cfg.sampling.max_new_tokens} new "
          f"tokens, prompts of {cfg.prompt_limit()}")
    print(f"{'engine generate peak memory':<34} {gen['peak_bytes'] / GiB:>12.2f} GiB  planned "
          f"{gen['planned_bytes'] / GiB:.2f} GiB ({gen['planned_bytes'] / gen['peak_bytes']:.2f}x)")
    print(f"{'host syncs in a decode step':<34} {gen['decode host syncs']:>12}")
    print(f"{'FP8 matmuls':<34} {mm['scaled_mm']:>12}")
    print(f"{'rollouts vs bf16 trainer':<34} {'KL':>12} {'max|dlogp|':>11} {'routes differ':>14}")
    for name in ("fp8 engine, replay off", "fp8 engine, replay on", "bf16 engine, replay off", "bf16 engine, replay on"):
        m = mm[name]
        print(f"{name:<34} {m['mismatch/kl']:>12.2e} {m['mismatch/max_abs_logp']:>11.2e} {m['mismatch/route_diff']:>14.4f}")
    ratio = mm["fp8 engine, replay off"]["mismatch/kl"] / max(mm["fp8 engine, replay on"]["mismatch/kl"], 1e-30)
    os.makedirs(os.path.join(ROOT, "bench", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "bench", "results", "gpu.json"), "w") as f:
        json.dump({"device": device, "torch": torch.__version__, "quick": a.quick,
                   "train": train, "engine": gen, "mismatch": mm, "kl_ratio_replay_off_over_on": ratio}, f, indent=1)
    print(f"{ratio:.1f}x lower FP8 train-inference KL with router replay (bf16 trainer, random-init "
          f"{os.path.basename(a.config)} model, {device})")


if __name__ == "__main__":
    main()
