"""NativeEngine generation throughput against transformers' `generate` with its KV cache, same run.

Both sides hold the same weights: a small Qwen3-MoE (4 layers, hidden 256, 8 heads, 2 KV
heads, head dim 32, 16 experts of 256, top-4, vocab 512, fp32) is built in transformers,
saved with save_pretrained and loaded into ours with `load_hf`; their prefill logits are
compared first. Both sample plainly (temperature 1, top_k 0, top_p 1) for exactly
`--new-tokens` tokens per row: no EOS can stop a row (ours: an EOS id never sampled;
transformers: no eos_token_id). Prefill is timed as a generate of one token; decode is
the full generate minus that, over new_tokens - 1 forward steps. Best of `--repeats`
rounds, every side run once per round (interleaved, so load drift hits both alike).

What bounds the ratio on a CPU: the expert GEMMs (about 0.4 GFLOP a step) and their 48 MB
of fp32 weights, more than the 32 MB L3, so every step streams them from memory. Both
sides run their experts with torch._grouped_mm; the rest is per-step overhead (the
engine's static cache, batched sampling and one host sync per STOP_CHECK_EVERY steps
against transformers' dynamic cache and per-step logits processing).

    python bench/rollout.py [--batch 64 --prompt-len 32 --new-tokens 128 --threads 2 --compile] [--smoke] [--out PATH]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from qwen3_small import small_qwen3_moe  # noqa: E402
from rollout import NativeEngine  # noqa: E402
from sampler import SamplingParams, Vocab  # noqa: E402
from bench import smoke  # noqa: E402  (bench/smoke.py)

NO_EOS = -1  # an id never sampled, so every row runs to the token limit
# --smoke: a few short rows, one round, one thread (two stall each other on busy shared cores)
SMOKE = {"batch": 4, "prompt_len": 8, "new_tokens": 8, "repeats": 1, "threads": 1}


def best_times(fns: dict, repeats: int) -> dict:
    """Best wall time of each fn, the fns interleaved in every round (a warm-up round first), so a
    change in machine load between rounds hits every side alike."""
    best = {name: float("inf") for name in fns}
    for r in range(repeats + 1):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            if r:
                best[name] = min(best[name], time.perf_counter() - t)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compile", action="store_true", help="also time NativeEngine with a torch.compile'd decode step")
    args = smoke.parse_args(ap, SMOKE)
    torch.set_num_threads(args.threads)
    import transformers

    ref, ours = small_qwen3_moe(max_positions=args.prompt_len + args.new_tokens)
    ref.eval()
    ref.generation_config.eos_token_id = None  # nothing stops a row early
    cfg = ours.cfg
    prompts = torch.randint(0, cfg.vocab_size, (args.batch, args.prompt_len))
    with torch.no_grad():
        parity = (ref(prompts).logits - ours(prompts)[0]).abs().max().item()

    def hf_generate(new_tokens):
        with torch.no_grad():
            out = ref.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True, temperature=1.0,
                               top_k=0, top_p=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
        assert out.shape[1] == args.prompt_len + new_tokens

    engines = {"native_engine": NativeEngine(cfg, Vocab(NO_EOS, 0))}
    if args.compile:
        engines["native_engine_compiled"] = NativeEngine(cfg, Vocab(NO_EOS, 0), compile=True)
    load_before = os.getloadavg()[0]
    rows, fns = prompts.tolist(), {}
    for name, engine in engines.items():
        engine.update_weights(ours.named_parameters(), version=0)

        def run(new_tokens, engine=engine):
            out = engine.generate(rows, SamplingParams(max_new_tokens=new_tokens), seed=0)
            assert all(len(r.completion_ids) == new_tokens for r in out)
        fns[name, "prefill"], fns[name, "total"] = (lambda run=run: run(1)), (lambda run=run: run(args.new_tokens))
    fns["transformers_generate", "prefill"] = lambda: hf_generate(1)
    fns["transformers_generate", "total"] = lambda: hf_generate(args.new_tokens)
    best = best_times(fns, args.repeats)
    results = {name: (best[name, "prefill"], best[name, "total"]) for name, _ in fns if _ == "prefill"}

    steps = args.new_tokens - 1
    table = {}
    for name, (t_prefill, t_total) in results.items():
        t_decode = t_total - t_prefill
        table[name] = {"prefill_s": t_prefill, "prefill_tokens_per_s": args.batch * args.prompt_len / t_prefill,
                       "decode_s": t_decode, "decode_ms_per_step": 1e3 * t_decode / steps,
                       "decode_tokens_per_s": args.batch * steps / t_decode, "total_s": t_total}
    base = table["transformers_generate"]
    for row in table.values():
        row["decode_speedup"] = row["decode_tokens_per_s"] / base["decode_tokens_per_s"]
        row["prefill_speedup"] = row["prefill_tokens_per_s"] / base["prefill_tokens_per_s"]
    # transformers picks torch._grouped_mm for its experts where it can (5.24 does on CPU fp32), the
    # same kernel as ours: the expert GEMMs cost both sides alike and the gap is per-step overhead
    experts_impl = getattr(ref.config, "_experts_implementation_internal", "unknown")
    print(f"transformers experts implementation: {experts_impl}")
    print(f"same weights: max |logit difference| on the prompts {parity:.1e}; batch {args.batch} x prompt "
          f"{args.prompt_len}, {args.new_tokens} new tokens, fp32, {args.threads} threads, best of {args.repeats}")
    print(f"{'engine':<24}{'prefill s':>10}{'prefill tok/s':>14}{'decode s':>10}{'ms/step':>9}{'decode tok/s':>13}{'vs HF':>7}")
    for name, r in table.items():
        print(f"{name:<24}{r['prefill_s']:>10.3f}{r['prefill_tokens_per_s']:>14.0f}{r['decode_s']:>10.3f}"
              f"{r['decode_ms_per_step']:>9.2f}{r['decode_tokens_per_s']:>13.0f}{r['decode_speedup']:>6.2f}x")
    load = (load_before, os.getloadavg()[0])
    busy = max(load) > os.cpu_count()
    smoke.write_results(args, "rollout", {
        "config": vars(args), "logit_parity": parity, "transformers_version": transformers.__version__,
        "transformers_experts_implementation": experts_impl,
        "torch_version": torch.__version__, "cpu_count": os.cpu_count(), "load_average_1min": load,
        "note": (f"contended: the 1-minute load average ({max(load):.1f}) exceeded the {os.cpu_count()} CPUs "
                 f"while this ran, so absolute times are inflated and noisy; both sides ran in the same "
                 f"window, so the ratio is the number to read" if busy else "quiet machine"),
        **table})
    ours_row = table["native_engine"]
    print(f"{ours_row['decode_speedup']:.2f}x decode tokens/s vs transformers generate (KV cache, plain sampling; "
          f"prefill {ours_row['prefill_speedup']:.2f}x; batch {args.batch}, prompt {args.prompt_len}, "
          f"{args.new_tokens} new tokens)")


if __name__ == "__main__":
    main()
