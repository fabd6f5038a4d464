"""Reward overlap: the fraction of reward time hidden behind generation by scoring.RewardPool.

The verifier takes `--verifier-ms` per rollout and waits rather than computes (time.sleep),
as a sandboxed code run or a remote reward model does. The rollouts come from the tiny
config's model shape (random weights, EOS never sampled, so every row runs to the token
limit) through train.generate_rollouts (the RL step's own), `--batches` generation batches of
`--rows` rows. Three runs in one process:

- generation alone: T_gen;
- generation, then scoring with the pool (the same workers, no overlap): the scoring
  part, T_reward, is what rewards add to a step when they do not overlap;
- generation with the pool scoring each batch as soon as it is generated: T_overlap.

Hidden fraction = 1 - (T_overlap - T_gen) / T_reward, T_gen the mean of a generation
alone just before and just after the overlapped run (this VM's speed drifts by several
percent between runs of a few seconds, which is what separates the repeats). Only the
last batch's rewards cannot hide, provided the pool keeps pace with generation: workers
>= rollouts/s x verifier time (here about 600/s x 50 ms = 30; the default 40 leaves
room). With fewer, scoring is the bottleneck and its excess shows however it overlaps
(16 workers: about 48% hidden); many more only add threads that wake and take CPU from
the generation they overlap. The default 32 batches of 64 rows (2048 rollouts: 256
prompts x 8) is one RL step of a usual size; the last batch's scoring is what stays
exposed. Also reported against scoring inline on the caller's thread (train.py with
reward.workers=0), whose reward time is rollouts x verifier time.

    python bench/reward_overlap.py [--verifier-ms 50 --workers 40 --batches 32 --rows 64 --threads 2 --repeats 7]
        [--smoke] [--out PATH]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train  # noqa: E402
from config import TrainConfig  # noqa: E402
from model import ModelConfig, Transformer  # noqa: E402
from data import Item, Task, Prompts  # noqa: E402
from rollout import NativeEngine  # noqa: E402
from sampler import SamplingParams, Vocab  # noqa: E402
from scheduler import LengthPredictor  # noqa: E402
from scoring import RewardPool  # noqa: E402
from tokenizer import build_tokenizer, demo_tokenizer  # noqa: E402
from bench import smoke  # noqa: E402  (bench/smoke.py)

NO_EOS = -1  # an id never sampled, so every row runs to the token limit
# --smoke: 2 batches of 16 short rows, a 5 ms verifier on 4 workers, one repeat, one thread (two stall each other
# on busy shared cores)
SMOKE = {"verifier_ms": 5.0, "workers": 4, "batches": 2, "rows": 16, "new_tokens": 4, "repeats": 1, "threads": 1}


class RandomPrompts(Task):
    """The bench's prompts as a task: each question is its own user message (the pool scores them)."""

    def __init__(self, items: list[Item]):
        self.items = items

    def user_message(self, item: Item) -> str:
        return item.question

    def demonstration(self, item: Item) -> str:
        return ""  # never trained on


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--verifier-ms", type=float, default=50.0)
    ap.add_argument("--workers", type=int, default=40, help="RewardPool threads")
    ap.add_argument("--batches", type=int, default=32, help="generation batches")
    ap.add_argument("--rows", type=int, default=64, help="rows (prompts x G) per generation batch")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7, help="repeats; the median one is reported")
    args = smoke.parse_args(ap, SMOKE)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    mcfg = ModelConfig(vocab_size=336, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, num_experts=8,
                       top_k=2, moe_inter_dim=128, max_seq_len=args.prompt_len + args.new_tokens)
    cfg = TrainConfig(model=mcfg, group_size=args.group_size, gen_batch_rows=args.rows,
                      sampling=SamplingParams(max_new_tokens=args.new_tokens))
    # prompts of random bytes: a byte-level tokenizer makes each exactly prompt_len tokens with <|bos|> and "\n"
    tok = demo_tokenizer(build_tokenizer(mcfg.vocab_size))
    engine = NativeEngine(mcfg, Vocab(NO_EOS, 0, decode=tok.decode))
    engine.update_weights(Transformer(mcfg).named_parameters(), version=0)
    num_prompts = args.batches * (args.rows // args.group_size)
    text = torch.randint(ord("a"), ord("z") + 1, (num_prompts, args.prompt_len - 2)).tolist()
    items = [Item("".join(map(chr, t)), "", 0, i) for i, t in enumerate(text)]
    delay = args.verifier_ms / 1000

    def verifier(completion: str, item) -> float:
        time.sleep(delay)
        return float(len(completion) % 2)

    run = train.Run(cfg=cfg, engine=engine, tok=tok,
                    prompts=Prompts(RandomPrompts(items), list(range(num_prompts)), tok, cfg.prompt_limit()),
                    predictor=LengthPredictor(prior=cfg.sampling.max_new_tokens / 2), filter_rng=random.Random(cfg.seed))

    def generate(pool=None):
        run.pool = pool  # with a pool, train.generate_rollouts hands each batch to it as soon as it is generated
        return train.generate_rollouts(run, items, args.group_size, step=0, gen_round=0)

    generate()  # warm-up
    runs = []  # per repeat: generate alone, reward alone, generate with overlapped reward (and its generation part)
    with RewardPool(verifier, workers=args.workers, timeout_s=60) as pool:
        for _ in range(args.repeats):  # adjacent runs, so a drift in this machine's speed hits all of them alike
            t = time.perf_counter()
            rollouts = generate()
            t_gen = time.perf_counter() - t

            t = time.perf_counter()
            for i, r in enumerate(rollouts):
                pool.submit(i, r.text, items[r.group_id])
            after, _ = pool.gather(list(range(len(rollouts))))
            t_reward = time.perf_counter() - t

            t = time.perf_counter()
            generate(pool)
            t_gen_overlapped = time.perf_counter() - t
            keys = [(0, g, j) for g in range(num_prompts) for j in range(args.group_size)]  # train.generate_rollouts' keys
            overlapped, reasons = pool.gather(keys)
            t_overlap = time.perf_counter() - t
            assert reasons == ["ok"] * len(rollouts) and sorted(overlapped) == sorted(after)

            t = time.perf_counter()  # generation alone again: the overlapped run is bracketed, so a linear drift cancels
            generate()
            t_gen = (t_gen + time.perf_counter() - t) / 2
            runs.append((1 - max(0.0, t_overlap - t_gen) / t_reward, t_gen, t_reward, t_overlap, t_gen_overlapped))

    runs.sort()
    hidden, t_gen, t_reward, t_overlap, t_gen_overlapped = runs[len(runs) // 2]  # the median repeat
    t_inline = len(rollouts) * delay
    exposed = max(0.0, t_overlap - t_gen)
    results = {
        "config": vars(args), "rollouts": len(rollouts), "generate_s": t_gen, "reward_after_generate_s": t_reward,
        "generate_with_overlapped_reward_s": t_overlap,
        "generate_part_of_overlapped_s": t_gen_overlapped, "reward_inline_s": t_inline,
        "hidden_fraction": hidden, "hidden_fraction_vs_inline": 1 - exposed / t_inline,
        "hidden_fraction_each_repeat": [r[0] for r in runs],
    }
    print(f"{'run':<44}{'seconds':>9}")
    for name, value in (("generate", t_gen), (f"reward after generate ({args.workers} workers)", t_reward),
                        ("generate with overlapped reward", t_overlap),
                        ("  of which generation", t_gen_overlapped), ("reward inline, one thread (computed)", t_inline)):
        print(f"{name:<44}{value:>9.2f}")
    smoke.write_results(args, "reward_overlap", results)
    print("hidden fraction of each repeat, sorted: " + ", ".join(f"{r[0]:.1%}" for r in runs))
    print(f"{results['hidden_fraction']:.1%} of reward time hidden behind generation, median of {len(runs)} "
          f"({len(rollouts)} rollouts, "
          f"{args.verifier_ms:.0f} ms verifier, {args.workers} workers; {results['hidden_fraction_vs_inline']:.1%} of "
          f"inline scoring's; target >= 90%)")


if __name__ == "__main__":
    main()
