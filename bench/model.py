"""Training forward+backward throughput of model.Transformer against transformers' Qwen3-MoE.

Both sides run the same weights (ours loaded from the HF model with `load_hf`) on the same
small Qwen3-MoE config: 4 layers, hidden 256, 8 heads, 2 KV heads, head dim 32, 16 experts
of 256, top-4, vocab 512; batch 8 x 512 tokens, fp32; loss = mean cross-entropy. The
baseline is transformers' default path (SDPA attention, its default experts kernel).
Model FLOP utilisation = 6 x matmul params a token uses (attention projections, router,
its top-k experts, lm_head; not the embedding lookup nor the attention scores) x tokens/s,
over an fp32 matmul peak measured in the same run (square matmuls, the best of sizes).

Our model runs twice: eager, and a copy with each block torch.compile'd (elementwise ops
fused; the grouped-GEMM experts stay eager in fp32, as torch compiles them for bf16 only), as
`parallelize(..., compile=True)` does. Every round times one step of each side, in
rotating order, and measures the peak again: this VM's speed drifts by tens of percent
within minutes, so speedups and MFU are medians of per-round ratios. The headline is the
eager ratio; the compiled one follows it.

    python bench/model.py [--threads 2 --rounds 9 --batch 8 --seq-len 512 --no-compile] [--smoke] [--out PATH]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model import ModelConfig  # noqa: E402
from qwen3_small import small_qwen3_moe  # noqa: E402
from bench import smoke  # noqa: E402  (bench/smoke.py)

# --smoke: one round of a short batch, eager only (compiling the blocks alone takes minutes on 2 cores), one
# thread (two stall each other on busy shared cores)
SMOKE = {"rounds": 1, "batch": 2, "seq_len": 32, "no_compile": True, "threads": 1}


def matmul_peak(dtype=torch.float32, seconds: float = 0.4) -> float:
    """Best FLOP/s of square fp32 matmuls of a few sizes, over about `seconds`."""
    best = 0.0
    for n in (1024, 2048):
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        a @ b
        reps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds / 2:
            a @ b
            reps += 1
        best = max(best, 2 * n ** 3 * reps / (time.perf_counter() - t0))
    return best


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=9, help="timed steps per side, interleaved")
    ap.add_argument("--batch", type=int, default=8, help="sequences per step")
    ap.add_argument("--seq-len", type=int, default=512, help="tokens per sequence")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile'd run")
    args = smoke.parse_args(ap, SMOKE)
    torch.set_num_threads(args.threads)
    import transformers
    B, T = args.batch, args.seq_len

    ref, ours = small_qwen3_moe(max_positions=T)
    ref, ours = ref.train(), ours.train()
    cfg: ModelConfig = ours.cfg
    tokens = torch.randint(0, cfg.vocab_size, (B, T))
    targets = torch.randint(0, cfg.vocab_size, (B, T))

    def step(model, hf: bool):
        def run():
            model.zero_grad(set_to_none=True)
            logits = model(tokens).logits if hf else model(tokens)[0]
            F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()).backward()
        return run

    sides = {"everyprompt": step(ours, False), "transformers": step(ref, True)}
    if not args.no_compile:
        compiled = copy.deepcopy(ours)
        for block in compiled.layers:
            block.compile()
        sides["everyprompt_compiled"] = step(compiled, False)
    for run in sides.values():  # warm-up (compiles)
        run()
        run()
    # This VM's speed drifts by tens of percent within minutes: every round times each side
    # once (order rotating) and measures the peak, and the ratios are per-round medians.
    times = {name: [] for name in sides}
    peaks = []
    for r in range(args.rounds):
        names = list(sides)[r % len(sides):] + list(sides)[:r % len(sides)]
        for name in names:
            times[name].append(timed(sides[name]))
        peaks.append(matmul_peak())
    D, H, G, d, K, I = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.top_k, cfg.moe_inter_dim
    per_layer = D * (H + 2 * G) * d + H * d * D + D * cfg.num_experts + K * 3 * D * I
    active = cfg.n_layers * per_layer + D * cfg.vocab_size
    flops = 6 * active * B * T
    med = lambda xs: sorted(xs)[len(xs) // 2]
    rows = {name: {"seconds": med(ts), "tokens_per_s": B * T / med(ts),
                   "mfu": med([flops / t / p for t, p in zip(ts, peaks)]),
                   "speedup": med([tr / t for tr, t in zip(times["transformers"], ts)])}
            for name, ts in times.items()}
    print(f"fp32 matmul peak: {med(peaks) / 1e9:.0f} GFLOP/s (median of rounds, {min(peaks) / 1e9:.0f}-"
          f"{max(peaks) / 1e9:.0f}); {active / 1e6:.2f}M active matmul params; batch {B} x {T}, "
          f"{args.threads} threads, {args.rounds} rounds")
    print(f"{'model':<22}{'s/step':>9}{'tokens/s':>10}{'MFU':>7}{'speedup':>9}")
    for name, r in rows.items():
        print(f"{name:<22}{r['seconds']:>9.3f}{r['tokens_per_s']:>10.0f}{r['mfu']:>7.1%}{r['speedup']:>8.2f}x")
    result = {"peak_flops": med(peaks), "peak_flops_rounds": peaks, "active_params": active, **rows,
              "seconds_rounds": times, "transformers_version": transformers.__version__,
              "threads": args.threads, "rounds": args.rounds, "batch": B, "seq_len": T}
    smoke.write_results(args, "model", result)
    ep, cp = rows["everyprompt"], rows.get("everyprompt_compiled")
    compiled = f"; {cp['speedup']:.2f}x and {cp['mfu']:.0%} with compiled blocks" if cp else ""
    print(f"{ep['speedup']:.2f}x tokens/s vs transformers Qwen3-MoE (fwd+bwd, fp32, eager, "
          f"{ep['mfu']:.0%} of fp32 matmul peak{compiled}; the same torch ops a GPU runs, on CPU)")


if __name__ == "__main__":
    main()
