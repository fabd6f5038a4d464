"""Training forward+backward throughput of model.Transformer against transformers' Qwen3-MoE.

Both sides run the same weights (ours loaded from the HF model with `load_hf`) on the same
small Qwen3-MoE config: 4 layers, hidden 256, 8 heads, 2 KV heads, head dim 32, 16 experts
of 256, top-4, vocab 512; batch 8 x 512 tokens, fp32; loss = mean cross-entropy. The
baseline is transformers' default path (SDPA attention, its default experts kernel).
Model FLOP utilisation = 6 x matmul params a token uses (attention projections, router,
its top-k experts, lm_head; not the embedding lookup nor the attention scores) x tokens/s,
over an fp32 matmul peak measured in the same run (square matmuls, the best of sizes).

Our model runs twice: eager, then with each block torch.compile'd (elementwise ops fused;
the grouped expert GEMMs stay eager in fp32), as `parallelize(..., compile=True)` does.
The headline is the eager ratio; the compiled one follows it.

    python bench/model.py [--threads 2 --steps 5 --no-compile]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model import ModelConfig  # noqa: E402
from qwen3_small import small_qwen3_moe  # noqa: E402

B, T = 8, 512


def matmul_peak(dtype=torch.float32, seconds: float = 1.0) -> float:
    """Best FLOP/s of square matmuls of a few sizes."""
    best = 0.0
    for n in (512, 1024, 2048):
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        a @ b
        reps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds / 3:
            a @ b
            reps += 1
        best = max(best, 2 * n ** 3 * reps / (time.perf_counter() - t0))
    return best


def step_time(fn, steps: int) -> float:
    """Median seconds of fn() over `steps` runs after two warm-ups."""
    fn()
    fn()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile'd run")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    ref, ours = small_qwen3_moe(max_positions=T)
    ref, ours = ref.train(), ours.train()
    cfg: ModelConfig = ours.cfg
    tokens = torch.randint(0, cfg.vocab_size, (B, T))
    targets = torch.randint(0, cfg.vocab_size, (B, T))

    def run_ours():
        logits, _ = ours(tokens)
        F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()

    def run_ref():
        logits = ref(tokens).logits
        F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()).backward()

    peak = matmul_peak()
    t_ours, t_ref = step_time(run_ours, args.steps), step_time(run_ref, args.steps)
    t_compiled = None
    if not args.no_compile:
        for block in ours.layers:
            block.compile()
        t_compiled = step_time(run_ours, args.steps)  # its warm-up runs compile
    D, H, G, d, K, I = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.top_k, cfg.moe_inter_dim
    per_layer = D * (H + 2 * G) * d + H * d * D + D * cfg.num_experts + K * 3 * D * I
    active = cfg.n_layers * per_layer + D * cfg.vocab_size
    flops = 6 * active * B * T
    rows = {name: {"seconds": t, "tokens_per_s": B * T / t, "mfu": flops / t / peak}
            for name, t in (("everyprompt", t_ours), ("everyprompt_compiled", t_compiled), ("transformers", t_ref))
            if t is not None}
    print(f"fp32 matmul peak: {peak / 1e9:.0f} GFLOP/s; {active / 1e6:.2f}M active matmul params; "
          f"batch {B} x {T}, {args.threads} threads")
    print(f"{'model':<22}{'s/step':>9}{'tokens/s':>10}{'MFU':>7}")
    for name, r in rows.items():
        print(f"{name:<22}{r['seconds']:>9.3f}{r['tokens_per_s']:>10.0f}{r['mfu']:>7.1%}")
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out, exist_ok=True)
    result = {"peak_flops": peak, "active_params": active, **rows, "speedup": t_ref / t_ours,
              "speedup_compiled": t_ref / t_compiled if t_compiled else None,
              "transformers_version": transformers.__version__, "threads": args.threads}
    with open(os.path.join(out, "model.json"), "w") as f:
        json.dump(result, f, indent=1)
    compiled = (f"; {t_ref / t_compiled:.2f}x and {rows['everyprompt_compiled']['mfu']:.0%} with compiled blocks"
                if t_compiled else "")
    print(f"{t_ref / t_ours:.2f}x tokens/s vs transformers Qwen3-MoE (fwd+bwd, fp32, eager, "
          f"{rows['everyprompt']['mfu']:.0%} of fp32 matmul peak{compiled}; targets 1.3x, 60%)")


if __name__ == "__main__":
    main()
