"""Continuous batching (NativeEngine(slots=N)) against the static engine, on a long-tailed length distribution.

The model: configs/tiny.py's (1.9M parameters, vocab 336) with random weights, fp32. Lengths vary because
`--stop-ids` ids of the vocabulary stop a row (ids 1..k, each about 1/336 likely per step with random
weights): with 8 of them the completion lengths are long-tailed (median near a fifth of the limit, about
7 percent of the rows reaching `--new-tokens`); the table prints the distribution drawn. Every engine
generates the same rows (`--prompts` random prompts of 8 to 32 tokens, `--n` samples each) with the same
seed and group ids, so each samples the same tokens (the count of rows whose completion differs from the
static call's is printed: float rounding can flip a near-tie). Three ways to run them:

- static_one_call: one generate call over every row, today's default: every row decodes until the
  last one stops.
- static_batches: calls of `--slots` rows each, in prompt order (the run's generation batches of that
  many rows): the KV cache of the continuous engine, each call decoding until its own longest row stops.
- continuous: NativeEngine(slots=`--slots`): a stopped row's slot takes the next row (its KV pages by
  default: every slot at full length).
- paged: NativeEngine(slots=`--paged-slots`, kv_tokens = the static batches' KV columns): more rows live in
  the same KV memory, since most rows stop early; a row short of a page would be preempted (the table
  counts preemptions and the most of the pool the rows held, "live MB").

Measured: tokens/s (completion tokens over wall time, prefill included) and useful tokens per decode
row-step (decode steps that fed a live row's token, over all rows decoded in every step; a static call
runs STOP_CHECK_EVERY-aligned steps past its longest row). Rounds interleave the three (a warm-up round
first), so a change in machine load hits each alike; median and min..max over `--repeats` rounds, and
the continuous engine's tokens/s ratio to each static way taken round by round. The headline compares
the paged engine with static_batches at equal KV memory: what a run does with gen_batch_rows = slots (the
large configs held 16 or 32 rows per call, bounded by their KV cache). On this CPU attention reads the pages
through a gather per layer and step, a copy a paged-attention kernel would not make on a GPU, which costs the
continuous engine part of what refilling slots gains (continuous_32_slots against static_batches). Against one call over every row (a
cache rows / slots times larger) the answer turns on how a decode step's cost grows with its rows:
on a CPU with this tiny model it barely does (per-op overhead dominates), so fewer, wider steps win.

    python bench/continuous.py [--prompts 16 --n 8 --slots 32 --paged-slots 64 --new-tokens 128 --repeats 5 --threads 1]
        [--smoke] [--out PATH]
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from model import ModelConfig, Transformer  # noqa: E402
from config import EngineConfig  # noqa: E402
from rollout import STOP_CHECK_EVERY, NativeEngine  # noqa: E402
from sampler import SamplingParams, Vocab  # noqa: E402
from bench import smoke  # noqa: E402  (bench/smoke.py)

PAD = 0
PROMPT_LENS = (8, 32)  # prompt tokens, drawn uniformly: the continuous engine's slots hold ragged prompts
# --smoke: 16 rows in static calls of 8, 8 and 16 slots, a short limit that some rows still reach; one round
SMOKE = {"prompts": 4, "n": 4, "slots": 8, "paged_slots": 16, "new_tokens": 16, "repeats": 1}


def tiny_model_config() -> ModelConfig:
    """configs/tiny.py's model section (a config file of plain assignments)."""
    spec = importlib.util.spec_from_file_location("tiny", os.path.join(ROOT, "configs", "tiny.py"))
    tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny)
    return ModelConfig(**tiny.model)


def static_decode_row_steps(lengths: list[int], new_tokens: int) -> int:
    """Rows x decode steps of one static generate call whose rows sampled `lengths` tokens: it samples
    until every row stopped, checked every STOP_CHECK_EVERY steps, and feeds all but its last sample."""
    steps = min(new_tokens, STOP_CHECK_EVERY * math.ceil(max(lengths) / STOP_CHECK_EVERY))
    return len(lengths) * (steps - 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt (the group size)")
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--paged-slots", type=int, default=64,
                    help="slots of the paged engine given the static batches' KV memory (kv_tokens)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--stop-ids", type=int, default=8, help="ids 1..k stop a row: the higher, the shorter")
    ap.add_argument("--repeats", type=int, default=5)
    # 1 by default: on shared, busy cores two OpenMP threads stall each other (bench/scheduler.py saw it too)
    ap.add_argument("--threads", type=int, default=1)
    args = smoke.parse_args(ap, SMOKE)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = tiny_model_config()
    model = Transformer(cfg)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(args.stop_ids + 1, cfg.vocab_size, (int(length),), generator=g).tolist()
               for length in torch.randint(PROMPT_LENS[0], PROMPT_LENS[1] + 1, (args.prompts,), generator=g)]
    params, stops = SamplingParams(max_new_tokens=args.new_tokens), list(range(1, args.stop_ids + 1))
    per_call = max(1, args.slots // args.n)  # whole groups per static batch: slots rows at most
    # the static batches' KV cache, in columns: what the paged engine gets at equal memory
    equal_kv = per_call * args.n * (max(map(len, prompts)) + args.new_tokens - 1)
    static_all, static = NativeEngine(cfg, Vocab(stops, PAD)), NativeEngine(cfg, Vocab(stops, PAD))
    continuous = NativeEngine(cfg, Vocab(stops, PAD), options=EngineConfig(slots=args.slots))
    paged = NativeEngine(cfg, Vocab(stops, PAD), options=EngineConfig(slots=args.paged_slots, kv_tokens=equal_kv))
    engines = {"static_one_call": static_all, f"static_batches_of_{per_call * args.n}": static,
               f"continuous_{args.slots}_slots": continuous, f"paged_{args.paged_slots}_slots": paged}
    for engine in engines.values():
        engine.update_weights(model.named_parameters(), version=0)

    def one_call():
        return static_all.generate(prompts, params, n=args.n, seed=0), None

    def batches():
        out, row_steps = [], 0
        for i in range(0, len(prompts), per_call):
            part = static.generate(prompts[i:i + per_call], params, n=args.n, seed=0,
                                   group_ids=list(range(i, min(i + per_call, len(prompts)))))
            row_steps += static_decode_row_steps([len(r.completion_ids) for r in part], args.new_tokens)
            out += part
        return out, row_steps

    def slots(engine):
        def run():
            out = engine.generate(prompts, params, n=args.n, seed=0)
            return out, engine.batch_stats["decode_row_steps"]
        return run

    ways = dict(zip(engines, (one_call, batches, slots(continuous), slots(paged))))
    times = {name: [] for name in ways}
    load_before = os.getloadavg()[0]
    for r in range(args.repeats + 1):  # round 0 warms up
        for name, fn in ways.items():
            t = time.perf_counter()
            rollouts, row_steps = fn()
            elapsed = time.perf_counter() - t
            if r:
                times[name].append(elapsed)
            else:  # what each way generated: the same every round (same seeds)
                lengths = [len(x.completion_ids) for x in rollouts]
                if row_steps is None:
                    row_steps = static_decode_row_steps(lengths, args.new_tokens)
                times[name + "/rollouts"] = [x.completion_ids for x in rollouts]
                times[name + "/row_steps"] = row_steps
                times[name + "/tokens"] = sum(lengths)
                times[name + "/useful"] = sum(c - 1 for c in lengths)
    reference = times.pop("static_one_call/rollouts")
    lengths = sorted(len(c) for c in reference)
    dist = {"mean": statistics.mean(lengths), "p50": statistics.median(lengths),
            "p90": lengths[int(0.9 * len(lengths))], "max": lengths[-1],
            "at_limit": sum(c == args.new_tokens for c in lengths) / len(lengths)}
    table = {}
    for name in ways:
        tok, ts = times[name + "/tokens"], times[name]
        table[name] = {"median_s": statistics.median(ts), "min_s": min(ts), "max_s": max(ts),
                       "tokens": tok, "tokens_per_s": tok / statistics.median(ts),
                       "decode_row_steps": times[name + "/row_steps"],
                       "useful_per_row_step": times[name + "/useful"] / times[name + "/row_steps"],
                       "rows_differing_from_static_one_call": sum(
                           a != b for a, b in zip(times.pop(name + "/rollouts", reference), reference)),
                       # KV bytes the engine allocated (its largest call's; a paged pool whole) and, paged, the
                       # most pages its rows held at once (their live tokens, in pages), and its preemptions
                       "kv_bytes": engines[name].kv_bytes,
                       "kv_bytes_live_peak": (engines[name].batch_stats["peak_pages"] * 16 * engines[name].kv_bytes
                                              // ((engines[name].batch_stats["pages"] + 1) * 16)
                                              if engines[name].slots else engines[name].kv_bytes),
                       "preemptions": engines[name].batch_stats.get("preemptions", 0)}
    cont, page = f"continuous_{args.slots}_slots", f"paged_{args.paged_slots}_slots"
    for name in ways:  # round by round: each round's runs share the machine's load
        for way, key in ((cont, "continuous_speedup"), (page, "paged_speedup")):
            ratios = [b / a for a, b in zip(times[way], times[name])]
            table[name][key] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}

    rows = args.prompts * args.n
    print(f"configs/tiny.py model, random weights, fp32, {args.threads} threads; {rows} rows ({args.prompts} prompts "
          f"x {args.n}), prompts {PROMPT_LENS[0]}-{PROMPT_LENS[1]} tokens, <= {args.new_tokens} new tokens, "
          f"{args.stop_ids} stop ids; median (min..max) of {args.repeats} interleaved rounds")
    print(f"completion lengths: mean {dist['mean']:.1f}, p50 {dist['p50']:.0f}, p90 {dist['p90']}, max {dist['max']}, "
          f"{100 * dist['at_limit']:.1f}% reach the limit")
    print(f"{'engine':<24}{'wall s':>22}{'tokens/s':>10}{'useful/row-step':>17}{'row-steps':>11}{'differ':>8}"
          f"{'KV MB':>8}{'live MB':>9}{'preempt':>9}{'paged x':>20}")
    for name, r in table.items():
        s = r["paged_speedup"]
        print(f"{name:<24}{r['median_s']:>8.2f} ({r['min_s']:.2f}..{r['max_s']:.2f}){r['tokens_per_s']:>10.0f}"
              f"{r['useful_per_row_step']:>17.2f}{r['decode_row_steps']:>11}"
              f"{r['rows_differing_from_static_one_call']:>8}{r['kv_bytes'] / 1e6:>8.2f}"
              f"{r['kv_bytes_live_peak'] / 1e6:>9.2f}{r['preemptions']:>9}"
              f"{s['median']:>9.2f} ({s['min']:.2f}..{s['max']:.2f})")
    load = (load_before, os.getloadavg()[0])
    busy = max(load) > os.cpu_count()
    smoke.write_results(args, "continuous", {
        "config": vars(args), "torch_version": torch.__version__, "cpu_count": os.cpu_count(),
        "load_average_1min": load,
        "note": (f"contended: the 1-minute load average ({max(load):.1f}) exceeded the {os.cpu_count()} "
                 "CPUs while this ran, so absolute times are inflated and noisy; the ways ran interleaved, "
                 "so the ratios are the numbers to read" if busy else "quiet machine"),
        "lengths": dist, **table})
    per, one = table[f"static_batches_of_{per_call * args.n}"], table["static_one_call"]
    print(f"{per['continuous_speedup']['median']:.2f}x tokens/s with continuous batching alone ({args.slots} slots vs "
          f"static calls of {per_call * args.n} rows, the same KV cache; useful tokens per decode row-step "
          f"{table[cont]['useful_per_row_step']:.2f} vs {per['useful_per_row_step']:.2f}); "
          f"{one['paged_speedup']['median']:.2f}x for the paged engine vs one static call of all {rows} rows "
          f"({one['kv_bytes'] / table[page]['kv_bytes']:.1f}x its KV memory)")
    print(f"{per['paged_speedup']['median']:.2f}x tokens/s with continuous batching over a paged KV cache on a "
          f"long-tailed length distribution at equal KV memory ({args.paged_slots} slots in "
          f"{table[page]['kv_bytes'] / 1e6:.2f} MB of pages vs static generate calls of {per_call * args.n} rows in "
          f"{per['kv_bytes'] / 1e6:.2f} MB; its rows held at most {table[page]['kv_bytes_live_peak'] / 1e6:.2f} MB)")

if __name__ == "__main__":
    main()
