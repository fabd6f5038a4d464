"""Length-aware scheduling and the async loop: rollout wall time and RL step time, each against its baseline.

Three measurements, each with its baseline in the same run:

1. simulated, `--workers` rollout workers (ranks) driven as train.generate_rollouts drives them:
   each prompt (`--prompt-len` tokens) has a mean completion length drawn from a long-tailed
   lognormal; its G rollouts scatter around that mean. A step's `--prompts` prompts go out in
   generation batches of `--rows` rows (rows / G prompts) per worker, every worker in every batch
   and all of them in lockstep: a worker's share takes as many decode steps as its longest
   rollout (a batched engine computes finished rows until the call ends; a decode step costs
   DECODE_STEP_MS + DECODE_ROW_MS per row), and a batch takes its slowest worker's share. Wall
   time = the sum over batches. Both schedules are the run's own scheduler.generation_batches:
   length-aware with the scheduler.LengthPredictor trained on one earlier pass over the prompts
   (so its predictions are imperfect): each bucket of rows / G x workers prompts of similar
   predicted length, longest first, dealt round-robin over the workers; FIFO with an untrained
   predictor, which predicts every prompt alike, so the batches are the prompts in draw order,
   dealt the same way (what the run's first step does). Also reported: the same with an oracle
   predictor (each prompt's mean length in this very pass), the most better predictions could buy.
   An engine that refills finished rows (SGLang) refills only inside a generate call, and a call
   ends with its last row: the run hands the engine one lockstep batch at a time, so the same
   static-batch cost applies to it (continuous batching across a whole step is nothing the run does).
2. the real NativeEngine with the tiny config's model, one engine (one worker), `--engine-prompts`
   prompts of G rollouts: the same long-tailed lengths, the same two generation_batches schedules
   (FIFO: draw order; length-aware: the trained predictor), each batch generated for real. The
   random weights never sample EOS, so every batch is generated to the longest length drawn for
   its rows, which is the number of decode steps it would take had its rows stopped at their
   drawn lengths (the engine computes finished rows until all are done). Measured wall time,
   twice each, best kept.
3. RL step time on the tiny config (configs/tiny.py: model, task, batch sizes): one short
   SFT warm-up, then `--rl-steps` steps of train.main synchronous (max_staleness=0, torch's
   threads) against async (max_staleness=1: generation of step s+1 overlaps training of step
   s; one CPU thread each for producer and trainer). Sync runs twice, with 2 torch threads
   and with 1 (on shared cores two OpenMP threads can stall each other), and async is
   compared with the faster. Time per step = RL wall time / steps, pipeline fill included;
   runs alternate, best of `--repeats` kept. Then the overlap ceiling: a generate call and
   a train step of the tiny model run one after the other, in two threads and in two
   processes. On cores other jobs keep busy there is nothing to overlap onto, and async
   cannot win; two threads well below two processes would point at the GIL instead.

    python bench/scheduler.py [--workers 4 --rl-steps 10 --skip-async] [--smoke] [--out PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from scheduler import LengthPredictor, generation_batches  # noqa: E402
from sampler import Vocab
from bench import smoke  # noqa: E402  (bench/smoke.py)

# long-tailed completion lengths: lognormal prompt means, lognormal spread of a prompt's rollouts
MEDIAN_TOKENS = 48  # median of a prompt's mean completion length (simulated)
PROMPT_SIGMA = 0.9  # log-space std across prompts: the long tail (p99 / median about 8)
ROLLOUT_SIGMA = 0.3  # log-space std of a prompt's rollouts around its mean
# a decode step of the tiny model on this CPU: about 20 ms for a batch of 64, mostly fixed cost (DESIGN.md)
DECODE_STEP_MS = 15.0
DECODE_ROW_MS = 0.08
TINY_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "tiny.py")
SCHEDULES = ("fifo", "length_aware", "length_aware_oracle")  # the simulated ones, baseline first
# --smoke: every part at a few prompts of at most 32 tokens, one trial, repeat and RL step each
SMOKE = {"prompts": 64, "max_len": 32, "trials": 1, "engine_prompts": 4, "engine_rows": 16, "sft_steps": 1,
         "rl_steps": 1, "rl_prompts": 2, "eval_size": 8, "repeats": 1, "overlap_reps": 1, "overlap_prompts": 2}


def draw_lengths(num_prompts: int, group_size: int, max_len: int, rng: random.Random):
    """Per prompt: its mean length, and two draws of its G rollout lengths (an earlier pass, this pass)."""
    means = [MEDIAN_TOKENS * math.exp(rng.gauss(0, PROMPT_SIGMA)) for _ in range(num_prompts)]

    def group(mu):
        return [max(1, min(max_len, round(mu * math.exp(rng.gauss(0, ROLLOUT_SIGMA))))) for _ in range(group_size)]

    return means, [group(mu) for mu in means], [group(mu) for mu in means]


def predictor(seen: list[list[int]] | None = None) -> LengthPredictor:
    """A scheduler.LengthPredictor that has observed every rollout length of `seen` under its prompt's
    index (as the run's predictor observes each step's completions); None: untrained, every prompt alike."""
    p = LengthPredictor(prior=MEDIAN_TOKENS)
    for key, lens in enumerate(seen or []):
        for n in lens:
            p.observe(key, n)
    return p


def schedule(pred: LengthPredictor, num_prompts: int, prompt_len: int, rows_per_batch: int,
             workers: int) -> list[list[list[int]]]:
    """Per generation batch, each worker's share (prompt indices), as train.generate_rollouts gets them from
    scheduler.generation_batches: prompts keyed by their index, all prompt_len tokens long."""
    requests = [(i, None, prompt_len) for i in range(num_prompts)]
    shares = [generation_batches(pred, requests, rows_per_batch, num_ranks=workers, rank=w) for w in range(workers)]
    return [list(batch) for batch in zip(*shares)]  # every worker gets as many shares as there are batches


def batch_ms(lengths: list[int]) -> float:
    """Simulated cost of one worker's share of a batch: its longest rollout's decode steps (0 when empty)."""
    return max(lengths) * (DECODE_STEP_MS + DECODE_ROW_MS * len(lengths)) if lengths else 0.0


def simulate(args) -> dict:
    """Mean wall time (ms) over trials of the step's generation batches, workers in lockstep, per schedule."""
    per_batch = max(1, args.rows // args.group_size)  # prompts per worker in a batch, as train.generate_rollouts
    totals = dict.fromkeys(SCHEDULES, 0.0)
    batches = dict.fromkeys(SCHEDULES, 0)
    for trial in range(args.trials):
        rng = random.Random(trial)
        _, earlier, now = draw_lengths(args.prompts, args.group_size, args.max_len, rng)
        predictors = {"fifo": predictor(), "length_aware": predictor(earlier), "length_aware_oracle": predictor(now)}
        for name, pred in predictors.items():
            plan = schedule(pred, args.prompts, args.prompt_len, per_batch, args.workers)
            # lockstep: a batch ends when its slowest worker's share does
            totals[name] += sum(max(batch_ms([n for i in share for n in now[i]]) for share in b) for b in plan)
            batches[name] = len(plan)
    return {"ms": {k: v / args.trials for k, v in totals.items()}, "batches": batches}


def real_engine(args) -> dict:
    """Measured wall time (s) of generating every prompt's G rollouts in FIFO and in length-aware batches."""
    from rollout import NativeEngine
    from sampler import SamplingParams
    from config import load_config
    from model import Transformer
    cfg = load_config(TINY_CONFIG, [])
    torch.manual_seed(0)
    engine = NativeEngine(cfg.model, Vocab(-1, 0))  # eos -1: never sampled, rows run to the batch's limit
    engine.update_weights(Transformer(cfg.model).named_parameters(), version=0)
    rng = random.Random(1)
    max_len = min(args.max_len, cfg.model.max_seq_len - args.prompt_len)  # what fits the tiny model's positions
    _, earlier, now = draw_lengths(args.engine_prompts, args.group_size, max_len, rng)
    prompts = torch.randint(1, cfg.model.vocab_size, (args.engine_prompts, args.prompt_len)).tolist()
    per_batch = max(1, args.engine_rows // args.group_size)
    # one engine: one worker, whose share of each batch is the whole batch
    schedules = {name: [shares[0] for shares in schedule(pred, args.engine_prompts, args.prompt_len, per_batch, 1)]
                 for name, pred in (("fifo", predictor()), ("length_aware", predictor(earlier)))}

    def run(batches):
        t = time.perf_counter()
        for b in batches:
            limit = max(n for i in b for n in now[i])
            engine.generate([prompts[i] for i in b], SamplingParams(max_new_tokens=limit), n=args.group_size, seed=0)
        return time.perf_counter() - t

    run(schedules["length_aware"][:1])  # warm-up
    out = {name: float("inf") for name in schedules}
    for _ in range(2):  # alternate, keep the best: other processes share these cores
        for name, batches in schedules.items():
            out[name] = min(out[name], run(batches))
    out["decode_steps_fifo"] = sum(max(n for i in b for n in now[i]) for b in schedules["fifo"])
    out["decode_steps_length_aware"] = sum(max(n for i in b for n in now[i]) for b in schedules["length_aware"])
    out["rollout_tokens"] = sum(map(sum, now))
    return out


def rl_step_time(args) -> dict:
    """Seconds per RL step of the tiny config, synchronous against max_staleness=1."""
    import train
    from config import load_config
    tmp = tempfile.mkdtemp(prefix="bench_scheduler_")
    quiet = dict(eval_size=args.eval_size, eval_every=10 ** 6)
    if args.rl_prompts:
        quiet["prompts_per_step"] = args.rl_prompts

    def run(overrides):
        cfg = load_config(TINY_CONFIG, [f"{k}={v}" for k, v in {**quiet, **overrides}.items()])
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            train.main(cfg)
        records = [json.loads(line) for line in open(os.path.join(cfg.out_dir, "metrics.jsonl"))]
        rl = [r for r in records if r["stage"] == "rl"]
        start = next(r["time"] for r in records if r["stage"] == "eval")  # the eval before RL
        return rl, (rl[-1]["time"] - start) / len(rl)

    sft_dir = os.path.join(tmp, "sft")
    t = time.perf_counter()
    run(dict(out_dir=sft_dir, sft_steps=args.sft_steps, rl_steps=1))
    t_sft = time.perf_counter() - t
    common = dict(init_from=sft_dir, sft_steps=0, rl_steps=args.rl_steps)
    loops = {  # name: (torch threads of the main thread, overrides)
        "sync, 2 threads": (2, {}),
        "sync, 1 thread": (1, {}),
        "async, 1 + 1 threads": (2, dict(max_staleness=1, rollout_threads=1, trainer_threads=1, ckpt_every=0)),
    }
    best = {name: float("inf") for name in loops}
    detail = {}
    for r in range(args.repeats):
        for i, (name, (threads, extra)) in enumerate(loops.items()):
            torch.set_num_threads(threads)
            rl, per_step = run(dict(common, out_dir=os.path.join(tmp, f"loop{i}_{r}"), **extra))
            if per_step < best[name]:
                best[name] = per_step
                detail[name] = {
                    "t_generate_mean": sum(x["t_generate"] for x in rl) / len(rl),
                    "t_train_mean": sum(x.get("t_train", 0.0) for x in rl) / len(rl),
                    "reward_mean": sum(x["reward"] for x in rl) / len(rl),
                    "staleness_max": max(x.get("async/staleness_max", 0) for x in rl),
                    "trainer_wait_mean": sum(x.get("async/wait", 0.0) for x in rl) / len(rl),
                }
    torch.set_num_threads(args.threads)
    shutil.rmtree(tmp)  # kept when a run fails, for its metrics.jsonl
    return {"s_per_step": best, "detail": detail, "sft_s": t_sft}


def overlap_ceiling(args) -> dict:
    """Seconds for `n` generate calls and `n` train steps of the tiny model run one after the other,
    in two threads, and in two processes: whether this machine has idle capacity to overlap onto."""
    import multiprocessing as mp
    import threading
    from rollout import NativeEngine
    from sampler import SamplingParams
    from config import load_config
    from model import Transformer
    cfg = load_config(TINY_CONFIG, [])
    model = Transformer(cfg.model)
    engine = NativeEngine(cfg.model, Vocab(-1, 0))
    engine.update_weights(model.named_parameters(), version=0)
    # 8 rows a prompt (256 by default, as a tiny RL step's batch), half as many trained on
    prompts = torch.randint(1, cfg.model.vocab_size, (args.overlap_prompts, 20)).tolist()
    x_BT = torch.randint(1, cfg.model.vocab_size, (4 * args.overlap_prompts, 44))
    n = args.overlap_reps

    def generate():
        torch.set_num_threads(1)
        for _ in range(n):
            engine.generate(prompts, SamplingParams(max_new_tokens=cfg.sampling.max_new_tokens), n=8, seed=0)

    def train_steps():
        torch.set_num_threads(1)
        for _ in range(n):
            logits, _ = model(x_BT)
            logits.logsumexp(-1).mean().backward()

    generate(), train_steps()  # warm-up
    t = time.perf_counter()
    generate(), train_steps()
    out = {"sequential_s": time.perf_counter() - t}
    threads = [threading.Thread(target=f) for f in (generate, train_steps)]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    out["two_threads_s"] = time.perf_counter() - t
    proc = mp.get_context("fork").Process(target=generate)
    t = time.perf_counter()
    proc.start()
    train_steps()
    proc.join()
    out["two_processes_s"] = time.perf_counter() - t
    torch.set_num_threads(args.threads)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=4, help="simulated rollout workers")
    ap.add_argument("--prompts", type=int, default=512, help="simulated prompts per step")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--rows", type=int, default=64, help="rows (prompts x G) per worker in a generation batch "
                    "(gen_batch_rows)")
    ap.add_argument("--max-len", type=int, default=1024,
                    help="generation limit (tokens), simulated, and real where the tiny model's positions allow it")
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--engine-prompts", type=int, default=64)
    ap.add_argument("--engine-rows", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=24, help="tokens of every prompt (simulated and real)")
    ap.add_argument("--sft-steps", type=int, default=150)
    ap.add_argument("--rl-steps", type=int, default=8)
    ap.add_argument("--rl-prompts", type=int, default=None, help="prompts per RL step (default: configs/tiny.py's)")
    ap.add_argument("--eval-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--overlap-reps", type=int, default=3)
    ap.add_argument("--overlap-prompts", type=int, default=32, help="prompts (x 8 rows) of each generate call of the "
                    "overlap ceiling")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of parts 1-2 (2 OpenMP threads on 2 shared cores stall)")
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--skip-async", action="store_true")
    args = smoke.parse_args(ap, SMOKE)
    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]
    results = {"config": vars(args), "load_avg_1min_at_start": load, "cpu_count": os.cpu_count()}

    sim = simulate(args)
    results["simulated_ms"], results["simulated_batches"] = sim["ms"], sim["batches"]
    ms = sim["ms"]
    results["simulated_speedup"] = ms["fifo"] / ms["length_aware"]
    results["simulated_oracle_speedup"] = ms["fifo"] / ms["length_aware_oracle"]
    print(f"1. simulated: {args.prompts} prompts x G={args.group_size}, scheduler.generation_batches of {args.rows} rows "
          f"per worker, {args.workers} workers in lockstep, lognormal lengths (median {MEDIAN_TOKENS}), mean of "
          f"{args.trials} trials")
    print(f"   {'schedule':<36}{'wall (s)':>10}{'batches':>9}{'vs FIFO':>9}")
    for k in SCHEDULES:
        print(f"   {k:<36}{ms[k] / 1000:>10.2f}{sim['batches'][k]:>9}{ms['fifo'] / ms[k]:>8.2f}x")
    if not args.skip_engine:
        eng = real_engine(args)
        results["engine_s"] = eng
        results["engine_speedup"] = eng["fifo"] / eng["length_aware"]
        print(f"2. NativeEngine, tiny model, {args.engine_prompts} prompts x G={args.group_size}, {args.engine_rows}-row batches, "
              f"{eng['rollout_tokens']} rollout tokens")
        print(f"   {'schedule':<36}{'wall (s)':>10}{'decode steps':>14}{'vs FIFO':>9}")
        for k in ("fifo", "length_aware"):
            print(f"   {k:<36}{eng[k]:>10.2f}{eng[f'decode_steps_{k}']:>14}{eng['fifo'] / eng[k]:>8.2f}x")
    if not args.skip_async:
        rl = rl_step_time(args)
        results["rl_step"] = rl
        step_s = rl["s_per_step"]
        sync_best = min(v for k, v in step_s.items() if k.startswith("sync"))
        results["async_speedup"] = sync_best / step_s["async, 1 + 1 threads"]
        print(f"3. RL step, configs/tiny.py after {args.sft_steps} SFT steps, {args.rl_steps} RL steps, best of {args.repeats}")
        print(f"   {'loop':<36}{'s/step':>10}{'generate':>10}{'train':>9}{'wait':>8}{'vs best sync':>14}")
        for k, v in step_s.items():
            d = rl["detail"][k]
            print(f"   {k:<36}{v:>10.2f}{d['t_generate_mean']:>10.2f}{d['t_train_mean']:>9.2f}"
                  f"{d['trainer_wait_mean']:>8.2f}{sync_best / v:>13.2f}x")
        ceil = overlap_ceiling(args)
        results["overlap_ceiling"] = ceil
        print(f"   overlap ceiling, {args.overlap_reps} generate calls + {args.overlap_reps} train steps, 1 thread each:")
        for k, v in ceil.items():
            print(f"   {k:<36}{v:>10.2f}{ceil['sequential_s'] / v:>8.2f}x")
    smoke.write_results(args, "scheduler", results)
    line = (f"{results['simulated_speedup']:.2f}x rollout wall time, length-aware vs FIFO generation batches "
            f"({args.workers} simulated workers in lockstep; {results['simulated_oracle_speedup']:.2f}x with an oracle "
            f"predictor)")
    if "engine_speedup" in results:
        line += f"; {results['engine_speedup']:.2f}x with the real NativeEngine"
    if "async_speedup" in results:
        line += f"; {results['async_speedup']:.2f}x RL step time, async (staleness 1) vs the faster sync"
    print(line + "; targets >= 1.3x, 1.3x, 1.4x")


if __name__ == "__main__":
    main()
