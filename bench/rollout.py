"""NativeEngine decode throughput against uncached generation, measured in the same run.

Baseline: the same model and sampler with no KV cache, re-running the full forward over
prompt + completion-so-far for every new token (what `generate` costs without a cache).
Both generate exactly `new_tokens` tokens per row (EOS never stops a row here), fp32, on
the tiny config's shape with random weights.

    python bench/rollout.py [--batch 64 --prompt-len 32 --new-tokens 32 --threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model import ModelConfig, Transformer  # noqa: E402
from rollout import NativeEngine, sample  # noqa: E402

NO_EOS = -1  # an id never sampled, so every row runs to the token limit


@torch.no_grad()
def uncached_generate(model: Transformer, prompts_BP: torch.Tensor, new_tokens: int, gen: torch.Generator):
    seq = prompts_BP
    for _ in range(new_tokens):
        logits, _ = model(seq, return_routes=True)
        ids, _ = sample(logits[:, -1], temperature=1.0, top_p=1.0, generator=gen)
        seq = torch.cat([seq, ids[:, None]], dim=1)
    return seq


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=336, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, num_experts=8,
                      top_k=2, moe_inter_dim=128, max_seq_len=args.prompt_len + args.new_tokens)
    model = Transformer(cfg).eval()
    engine = NativeEngine(cfg, eos_id=NO_EOS, pad_id=0)
    engine.update_weights(model.named_parameters(), version=0)
    prompts = torch.randint(1, cfg.vocab_size, (args.batch, args.prompt_len))
    rows = prompts.tolist()

    t_engine = timed(lambda: engine.generate(rows, max_new_tokens=args.new_tokens, seed=0), args.repeats)
    gen = torch.Generator()
    t_base = timed(lambda: uncached_generate(model, prompts, args.new_tokens, gen.manual_seed(0)), args.repeats)
    tokens = args.batch * args.new_tokens
    results = {
        "config": vars(args),
        "native_engine": {"seconds": t_engine, "tokens_per_s": tokens / t_engine},
        "uncached_baseline": {"seconds": t_base, "tokens_per_s": tokens / t_base},
        "speedup": t_base / t_engine,
    }
    print(f"{'engine':<22}{'seconds':>10}{'tokens/s':>12}")
    for name in ("native_engine", "uncached_baseline"):
        print(f"{name:<22}{results[name]['seconds']:>10.3f}{results[name]['tokens_per_s']:>12.0f}")
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "rollout.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"{results['speedup']:.2f}x tokens/s vs uncached generation (batch {args.batch}, "
          f"prompt {args.prompt_len}, {args.new_tokens} new tokens)")


if __name__ == "__main__":
    main()
