"""Loss + backward time of every policy loss in espo.py against the per-sequence loop, measured in the same run.

Baseline: the float64 per-sequence, per-token loop references of tests/reference_losses.py
(the ones the parity tests trust), one Python iteration per sequence and per token. At
B=64, T=4096 they would take minutes per loss, so each is timed on the first
`--loop-seqs` sequences and scaled linearly by valid tokens (their cost is per token);
the output says so. The vectorised `espo.policy_loss` runs the whole batch, in float64
(the ratio's dtype, same as the loop) and in float32 (the training dtype).

Peak memory of the vectorised float32 loss + backward is read from torch.profiler's CPU
memory events (allocations minus frees in time order, at op granularity), inputs
excluded, and printed in bytes per padded token at T and T/4: a constant means O(B*T).

    python bench/loss.py [--batch 64 --seq-len 4096 --loop-seqs 8 --repeats 5 --threads 1] [--smoke] [--out PATH]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
from espo import LOSS_TYPES, PAPER_AGGREGATION, PAPER_CLIP_EPS, LossConfig, policy_loss  # noqa: E402
from reference_losses import reference_loss  # noqa: E402
from bench import smoke  # noqa: E402  (bench/smoke.py)

VOCAB = 151_936  # Qwen3's vocabulary: sets ESPO's log|V|
TIS_CAP = 2.0  # Yao et al.'s C
# (name, loss_type, extra options): every loss in its paper form, plus one with both optional terms on
CASES = [(t, t, {}) for t in LOSS_TYPES] + [("grpo+k3+tis", "grpo", {"kl_coef": 0.01, "tis_cap": TIS_CAP})]
SMOKE = {"batch": 4, "seq_len": 64, "loop_seqs": 2, "repeats": 1}  # --smoke: every loss, tiny batches


def make_batch(B: int, T: int, dtype: torch.dtype, seed: int = 0) -> dict:
    """Random [B, T] inputs, completion lengths uniform in [T/4, T], ratios around 1 so every branch is taken."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(T // 4, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).to(dtype)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    logp = old + 0.05 * torch.randn(B, T, generator=g, dtype=torch.float64)
    return {"logp": logp.to(dtype), "old": old.to(dtype), "mask": mask,
            "adv": torch.randn(B, generator=g, dtype=torch.float64).to(dtype),
            "ent": (torch.rand(B, T, generator=g, dtype=torch.float64) * 3).to(dtype),
            "ref": (old + 0.05 * torch.randn(B, T, generator=g, dtype=torch.float64)).to(dtype),
            "infer": (old + 0.05 * torch.randn(B, T, generator=g, dtype=torch.float64)).to(dtype)}


def vectorised(b: dict, loss_type: str, opts: dict):
    """One loss + backward of espo.policy_loss on the whole batch."""
    logp = b["logp"].detach().requires_grad_()
    cfg = LossConfig(type=loss_type, kl_coef=opts.get("kl_coef", 0.0), tis_cap=opts.get("tis_cap"))
    B, T = b["mask"].shape
    # Dr.GRPO's seq-mean-token-sum-norm divides by sequences x the generation budget (T here, as the loop's
    # max_tokens); every other aggregation takes this batch's own count
    normalizer = B * T if cfg.aggregation_name == "seq-mean-token-sum-norm" else None
    loss, _ = policy_loss(logp, b["old"], b["adv"], b["mask"], cfg, vocab_size=VOCAB, old_entropy_BT=b["ent"],
                          ref_logp_BT=b["ref"] if cfg.kl_coef else None, infer_logp_BT=b["infer"] if cfg.tis_cap else None,
                          normalizer=normalizer)
    loss.backward()


def loop(b: dict, loss_type: str, opts: dict, n_seqs: int):
    """One loss + backward of the float64 loop reference on the first n_seqs sequences."""
    s = slice(0, n_seqs)
    logp = b["logp"][s].detach().requires_grad_()
    eps_low, eps_high = PAPER_CLIP_EPS.get(loss_type, (0.0, 0.0))
    extra = {}
    if opts.get("kl_coef"):
        extra.update(ref=b["ref"][s], kl_coef=opts["kl_coef"])
    if opts.get("tis_cap"):
        extra.update(infer=b["infer"][s], tis_cap=opts["tis_cap"])
    loss = reference_loss(loss_type, logp, b["old"][s], b["adv"][s], b["mask"][s],
                          aggregation=PAPER_AGGREGATION[loss_type], eps_low=eps_low, eps_high=eps_high,
                          max_tokens=b["mask"].shape[1], ent=b["ent"][s], vocab_size=VOCAB, **extra)
    loss.backward()


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def peak_bytes(fn) -> int:
    """Peak of (allocated - freed) CPU bytes while fn runs, from the profiler's memory events."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--loop-seqs", type=int, default=8, help="sequences the loop reference is timed on")
    ap.add_argument("--repeats", type=int, default=5)
    # one thread: the loop reference is single-threaded Python anyway, and on a shared CPU a second
    # OpenMP thread that gets descheduled stalls every vectorised op at its barrier
    ap.add_argument("--threads", type=int, default=1)
    args = smoke.parse_args(ap, SMOKE)
    torch.set_num_threads(args.threads)
    B, T = args.batch, args.seq_len
    b64, b32, b32_small = make_batch(B, T, torch.float64), make_batch(B, T, torch.float32), make_batch(B, T // 4, torch.float32)
    tokens = float(b64["mask"].sum())
    loop_tokens = float(b64["mask"][:args.loop_seqs].sum())
    scale = tokens / loop_tokens

    rows = {}
    for name, loss_type, opts in CASES:
        t64 = timed(lambda: vectorised(b64, loss_type, opts), args.repeats)
        t32 = timed(lambda: vectorised(b32, loss_type, opts), args.repeats)
        t_loop = timed(lambda: loop(b64, loss_type, opts, args.loop_seqs), 1) * scale
        rows[name] = {"vectorised_fp64_s": t64, "vectorised_fp32_s": t32, "loop_fp64_s_scaled": t_loop,
                      "speedup_vs_loop": t_loop / t64}
        print(f"  {name}: {t64 * 1e3:.1f} ms vs loop {t_loop:.1f} s", file=sys.stderr)
    # after all timing: the profiler's threads would otherwise disturb later timings
    for name, loss_type, opts in CASES:
        peak = peak_bytes(lambda: vectorised(b32, loss_type, opts))
        peak_small = peak_bytes(lambda: vectorised(b32_small, loss_type, opts))
        rows[name].update({"peak_bytes_fp32": peak, "peak_bytes_per_token": peak / (B * T),
                           "peak_bytes_per_token_at_T_over_4": peak_small / (B * T // 4)})

    print(f"B={B}, T={T} ({tokens:.0f} valid tokens), {args.threads} threads; loop reference timed on "
          f"{args.loop_seqs} sequences ({loop_tokens:.0f} tokens) and scaled x{scale:.1f} by tokens")
    print(f"{'loss':<14}{'vec fp32 ms':>12}{'vec fp64 ms':>12}{'loop fp64 s':>13}{'speed-up':>10}"
          f"{'peak MiB':>10}{'B/token':>9}{'at T/4':>8}")
    for name, r in rows.items():
        print(f"{name:<14}{r['vectorised_fp32_s'] * 1e3:>12.1f}{r['vectorised_fp64_s'] * 1e3:>12.1f}"
              f"{r['loop_fp64_s_scaled']:>13.1f}{r['speedup_vs_loop']:>9.0f}x{r['peak_bytes_fp32'] / 2**20:>10.1f}"
              f"{r['peak_bytes_per_token']:>9.1f}{r['peak_bytes_per_token_at_T_over_4']:>8.1f}")
    worst = min(rows, key=lambda n: rows[n]["speedup_vs_loop"])
    results = {"config": vars(args), "vocab_size": VOCAB, "valid_tokens": tokens, "loop_tokens": loop_tokens,
               "loop_scale": scale, "losses": rows, "min_speedup": rows[worst]["speedup_vs_loop"], "min_speedup_loss": worst}
    smoke.write_results(args, "loss", results)
    print(f"{results['min_speedup']:.0f}x loss+backward vs per-sequence loop (the smallest over {len(rows)} losses, "
          f"{worst}; fp64 both; B={B}, T={T}; loop scaled from {args.loop_seqs} sequences); "
          f"peak memory {max(r['peak_bytes_per_token'] for r in rows.values()):.0f} bytes/token, O(B*T)")


if __name__ == "__main__":
    main()
