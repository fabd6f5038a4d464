"""This project's RL step against TRL's GRPOTrainer on the same work: seconds per RL step, generated tokens/s.

Both sides start from one random Qwen3-MoE checkpoint in the hub layout (tests/hf_checkpoint.py's
model: 2 layers of width 64, 8 experts of 32, top-2, fp32), with a real byte-level BPE
vocabulary and a ChatML template, and run RL on the same GSM8K prompts: 8 prompts x G = 8
rollouts per step, at most 64 new tokens, temperature 1, one AdamW step per RL step (lr 1e-5,
weight decay 0.1, gradient clipping 1.0, 10 warm-up steps), no KL term and no reference
model, rewards graded by reward.math_reward (math-verify) against the GSM8K gold. Prompts are
the project's own (data.py's user_message in the checkpoint's template; TRL gets the same text
as a conversational prompt and renders the same ids, checked below), and only rows whose prompt
fits hf_tiny's max_prompt_tokens are used, so neither side drops one.

- this project: train.main on configs/hf_tiny.py with init_hf, num_minibatches=1, loss.kl_coef=0,
  ckpt_every=0 and the smallest eval (1 held-out prompt, 1 sample; it runs before the first
  and after the last RL step, outside the timed steps). Time per step: the differences of
  metrics.jsonl's `time` between RL records; tokens: `filter/tokens_generated`.
- TRL 1.16: GRPOTrainer with the same folder's model and tokenizer, num_generations=8,
  8 prompts per optimizer step (--trl-microbatch rows per forward/backward, gradient
  accumulation over the rest of the 64), max_completion_length=64, beta=0, transformers'
  generate (no vLLM), fp32, no gradient checkpointing. Time per step: the differences between
  on_step_end callbacks; tokens: the lengths of the completion ids the reward function gets.

The table splits each step into generate+score (ours: t_generate; TRL: its
_generate_and_score_completions, which also tokenizes and takes the advantages) and the rest,
the update (forward, backward, AdamW; ours also copies the weights into its engine).

What differs, and why it is left so:
- pi_old: neither side runs a separate old-logprob pass. TRL with num_iterations=1 and its
  generation aligned to the optimizer step takes pi_old as the detached logprobs of the loss
  forward; so does this project with one mini-batch (trainer.train_on_rollouts), but its
  forward replays the experts the engine routed each token to (R3, router_replay), where TRL's
  routes afresh. Neither computes reference logprobs (loss.kl_coef 0, beta 0).
- zero-variance groups: a random checkpoint answers nothing right, so every group is all
  wrong. hf_tiny's RL-ZVP keeps them and gives their tokens entropy-shaped advantages, so every
  step trains; TRL trains on every group as well, with zero advantages (a zero loss whose
  backward and AdamW step still run). With filter.zero_variance='drop' this project would skip every
  update, which is no comparison.
- the loss: hf_tiny's ESPO against TRL's default 'dapo' token loss; both compute per-token
  entropy in the loss forward (ESPO's bins and RL-ZVP here, TRL's entropy metric), and the
  loss arithmetic is small beside the forward and backward.
- generation: this project's NativeEngine (static KV cache, batched sampling, the trainer's
  weights copied in after each step) against transformers' generate with its dynamic cache.
  Both stop a row at <|im_end|> or <|endoftext|>; the random model rarely samples either, and
  the tokens/s column counts what each side generated.
- MoE load balancing: this project trains no auxiliary loss; TRL's router_aux_loss_coef is set
  to 0 to match (the checkpoint's config would otherwise turn it on).
- micro-batches: this project packs rows up to microbatch_tokens=4096 padded tokens; TRL runs
  --trl-microbatch rows each.

Vocabulary (--vocab): with Qwen's 151,643 ranks the 64-wide model is almost all lm_head and
sampling over 151,936 logits per token, so both sides would be timing the vocabulary rather
than the model, and slowly. By default both use 'small': Qwen's first 1021 ranks (the 256 bytes and Qwen's first 765 merges, a
valid BPE of its own: a merge's parts always rank below it) with <|endoftext|>, <|im_start|>
and <|im_end|> after them, 1024 ids; the prompts take more tokens than with the full vocabulary.
'qwen' uses tests/hf_checkpoint.py's checkpoint as it is; give it few --steps and --rounds.

Each side runs in its own process (so neither's imports or allocator state touch the other),
and the sides alternate order every round. A run drops its first --warmup steps and reports
the medians of the rest (seconds, tokens/s); the table gives the medians of those over
--rounds rounds with their min-max spread, and the headline ratio is the median of the
per-round ratios (a round's two runs are adjacent in time, so load drift hits both alike).
One torch thread per side by default: on this VM's 2 cores, shared with other jobs, two
OpenMP threads stall each other whenever one is descheduled (bench/scheduler.py saw the
same), which made 2-thread runs of either side erratic; --threads 2 runs both sides so.

    python bench/trl.py [--rounds 5 --steps 5 --warmup 2 --vocab small|qwen --data ../shared/data --threads 1]
        [--smoke] [--out PATH]

--smoke: one round of one warm-up and one timed step per side, on GSM8K-format rows of its own (`--data ''`), so
it runs where the dataset is not (tests/test_bench.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# this file is named trl.py: with bench/ first on the path, `import trl` would import it instead of TRL
sys.path = [p for p in sys.path if os.path.abspath(p or os.curdir) != os.path.dirname(os.path.abspath(__file__))]
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # hf_checkpoint: the checkpoints the tests build

from bench import smoke  # noqa: E402  (bench/smoke.py)

HF_TINY = os.path.join(ROOT, "configs", "hf_tiny.py")
GROUP_SIZE = 8  # rollouts per prompt, both sides
PROMPTS_PER_STEP = 8  # prompts per RL step = per optimizer step
MAX_NEW_TOKENS = 64
LR = 1e-5  # hf_tiny's RL learning rate
WEIGHT_DECAY = 0.1  # CHECKPOINT_DEFAULTS' AdamW weight decay, which hf_tiny keeps
LR_WARMUP_STEPS = 10  # CHECKPOINT_DEFAULTS' linear warm-up (the rate changes nothing that is timed)
GRAD_CLIP = 1.0  # TrainConfig's grad_clip and TRL's max_grad_norm default alike
MAX_PROMPT_TOKENS = 256  # hf_tiny's: rows whose prompt is longer are left out of the pool, for both sides
SMALL_RANKS = 1021  # Qwen's first ranks kept by --vocab small: with the 3 specials, 1024 ids
CHATML_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids SMALL_RANKS + 0, 1, 2 in the small vocab
SMOKE = {"rounds": 1, "steps": 1, "warmup": 1, "data": ""}  # --smoke: one short run per side on rows of its own


# ----------------------------------------------------------------------------- the shared inputs

def small_checkpoint(path: str, num_ranks: int = SMALL_RANKS) -> str:
    """hf_checkpoint's random Qwen3-MoE with a vocabulary of Qwen's first `num_ranks` BPE ranks and
    ChatML's three specials after them (tokenizer.json built by the `tokenizers` library). Returns path."""
    import hf_checkpoint
    return hf_checkpoint.build_checkpoint(path, "qwen3_moe", num_ranks=num_ranks, specials=list(CHATML_SPECIALS))


def gsm8k_files(data_dir: str) -> tuple[str, str]:
    """Paths of GSM8K's train and test JSONL in data_dir; exits with a message if either is missing."""
    paths = tuple(os.path.join(data_dir, f"gsm8k_{split}.jsonl") for split in ("train", "test"))
    for p in paths:
        if not os.path.exists(p):
            sys.exit(f"{p} not found: --data must be the folder with GSM8K's gsm8k_train.jsonl and gsm8k_test.jsonl "
                     f"(the shared data folder, ../shared/data from the repo root)")
    return paths


def smoke_gsm8k(data_dir: str, num_rows: int) -> str:
    """GSM8K-format train and test JSONL of num_rows made-up word problems each (the test's unlike the train's),
    in data_dir (made); returns it. What --smoke trains on: the bench's own code path without the dataset."""
    os.makedirs(data_dir, exist_ok=True)
    for split, first in (("train", 0), ("test", num_rows)):
        with open(os.path.join(data_dir, f"gsm8k_{split}.jsonl"), "w") as f:
            for i in range(first, first + num_rows):
                a, b = 3 + i, 5 + 2 * i
                f.write(json.dumps({"question": f"Ann has {a} apples and buys {b} more. How many apples has she now?",
                                    "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}) + "\n")
    return data_dir


def prompt_pool(ckpt: str, data_dir: str, num_prompts: int, work: str) -> dict:
    """The GSM8K rows both sides train on: the first `num_prompts` training rows whose prompt (the
    project's wording, in the checkpoint's template) fits MAX_PROMPT_TOKENS, written to
    work/train.jsonl, and the first test row as the project's smallest eval, work/eval.jsonl. Returns
    their paths, the prompt messages and gold answers for TRL, and the prompt lengths."""
    from data import load_task
    from tokenizer import load_hf_tokenizer
    train_path, test_path = gsm8k_files(data_dir)
    tok, task = load_hf_tokenizer(ckpt), load_task(train_path)
    chosen = []
    for item in task.items:
        ids = tok.prompt_ids(task.user_message(item))
        if len(ids) <= MAX_PROMPT_TOKENS:
            chosen.append((item, len(ids)))
        if len(chosen) == num_prompts:
            break
    def write(path, items):  # GSM8K rows again: the gold after '####' is all the task reads of the answer
        with open(path, "w") as f:
            f.writelines(json.dumps({"question": it.question, "answer": f"#### {it.answer}"}) + "\n" for it in items)
    write(os.path.join(work, "train.jsonl"), [item for item, _ in chosen])
    write(os.path.join(work, "eval.jsonl"), load_task(test_path, size=1).items)
    return {"train": os.path.join(work, "train.jsonl"), "eval": os.path.join(work, "eval.jsonl"),
            "messages": [task.user_message(item) for item, _ in chosen], "golds": [item.answer for item, _ in chosen],
            "prompt_tokens": [n for _, n in chosen],
            "first_prompt_ids": tok.prompt_ids(task.user_message(chosen[0][0]))}


def same_prompt_ids(ckpt: str, message: str, ours: list[int]) -> bool:
    """Whether transformers renders the conversational prompt TRL gets to the ids this project generates from."""
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(ckpt)
    ids = hf.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    return list(ids) == list(ours)


# ----------------------------------------------------------------------------- one run of one side (a subprocess)

def run_ours(job: dict) -> dict:
    """train.main on hf_tiny with the job's checkpoint and prompts; per-step seconds and generated tokens."""
    import train
    from config import load_config
    out = os.path.join(job["work"], "ours")
    overrides = {"init_hf": job["ckpt"], "train_data": job["train"], "eval_data": job["eval"], "out_dir": out,
                 "rl_steps": job["num_steps"], "prompts_per_step": PROMPTS_PER_STEP, "group_size": GROUP_SIZE,
                 "sampling.max_new_tokens": MAX_NEW_TOKENS, "max_prompt_tokens": MAX_PROMPT_TOKENS,
                 "num_minibatches": 1, "lr": LR, "weight_decay": WEIGHT_DECAY, "lr_warmup_steps": LR_WARMUP_STEPS,
                 "grad_clip": GRAD_CLIP, "loss.kl_coef": 0.0, "filter.zero_variance": "rl-zvp", "ckpt_every": 0,
                 "eval_every": 10 ** 6, "eval_size": 1, "eval_samples": 1, "dtype": "float32", "seed": job["seed"]}
    cfg = load_config(HF_TINY, [f"{k}={v}" for k, v in overrides.items()])
    train.main(cfg)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rl = [r for r in map(json.loads, f) if r["stage"] == "rl"]
    assert len(rl) == job["num_steps"] and not any(r.get("skipped_update") for r in rl)
    return {"end_s": [r["time"] for r in rl], "tokens": [r["filter/tokens_generated"] for r in rl],
            "generate_s": [r["t_generate"] for r in rl], "train_s": [r["t_train"] for r in rl]}


def run_trl(job: dict) -> dict:
    """GRPOTrainer on the job's checkpoint and prompts; per-step seconds and generated tokens."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from reward import math_reward
    ends, tokens, generate_s = [], [], []

    def correct(completions, gold, completion_ids, **_):  # one call per step: its 64 completions
        tokens.append(sum(len(ids) for ids in completion_ids))
        return [math_reward(c[0]["content"], g) for c, g in zip(completions, gold)]

    class StepEnd(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

    batch = PROMPTS_PER_STEP * GROUP_SIZE
    if batch % job["trl_microbatch"]:
        raise ValueError(f"--trl-microbatch={job['trl_microbatch']} must divide the {batch} completions of a step")
    args = GRPOConfig(
        output_dir=os.path.join(job["work"], "trl"), per_device_train_batch_size=job["trl_microbatch"],
        gradient_accumulation_steps=batch // job["trl_microbatch"], num_generations=GROUP_SIZE,
        max_completion_length=MAX_NEW_TOKENS, learning_rate=LR, weight_decay=WEIGHT_DECAY, max_grad_norm=GRAD_CLIP,
        lr_scheduler_type="constant_with_warmup", warmup_steps=LR_WARMUP_STEPS, beta=0.0, num_iterations=1,
        temperature=1.0, top_p=1.0, top_k=0, use_vllm=False, use_cpu=True, bf16=False, fp16=False,
        gradient_checkpointing=False, router_aux_loss_coef=0.0, max_steps=job["num_steps"], logging_steps=1,
        report_to="none", save_strategy="no", seed=job["seed"], dataloader_num_workers=0)
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": m}], "gold": g}
                              for m, g in zip(job["messages"], job["golds"])])
    model = AutoModelForCausalLM.from_pretrained(job["ckpt"], dtype=torch.float32)
    trainer = GRPOTrainer(model=model, processing_class=AutoTokenizer.from_pretrained(job["ckpt"]),
                          reward_funcs=correct, args=args, train_dataset=data, callbacks=[StepEnd()])
    # generation, scoring and advantages happen in this method, once per step: time it for the breakdown
    generate_and_score = trainer._generate_and_score_completions

    def timed(*a, **kw):
        t = time.perf_counter()
        result = generate_and_score(*a, **kw)
        generate_s.append(time.perf_counter() - t)
        return result
    trainer._generate_and_score_completions = timed
    torch.set_num_threads(job["threads"])  # after accelerate's setup, which may set its own
    trainer.train()
    return {"end_s": ends, "tokens": tokens, "generate_s": generate_s, "threads": torch.get_num_threads()}


def child(job_path: str):
    """Run the side a job file names and write its result next to it."""
    import torch
    with open(job_path) as f:
        job = json.load(f)
    torch.set_num_threads(job["threads"])
    result = {"ours": run_ours, "trl": run_trl}[job["side"]](job)
    with open(job_path + ".result", "w") as f:
        json.dump(result, f)


def run_side(side: str, job: dict, work: str, timeout_s: float) -> dict:
    """One run of `side` in a fresh process; its output goes to a log, shown if it fails."""
    os.makedirs(work, exist_ok=True)
    job_path = os.path.join(work, "job.json")
    with open(job_path, "w") as f:
        json.dump({**job, "side": side, "work": work}, f)
    log = os.path.join(work, "log.txt")
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", job_path], stdout=f,
                              stderr=subprocess.STDOUT, cwd=ROOT, timeout=timeout_s)
    if proc.returncode:
        with open(log) as f:
            tail = f.read()[-4000:]
        cmd = f"{sys.executable} {os.path.abspath(__file__)} --child {job_path}"
        sys.exit(f"{side} side failed (exit {proc.returncode}); rerun alone with:\n  {cmd}\nlast output:\n{tail}")
    with open(job_path + ".result") as f:
        return json.load(f)


def per_step(result: dict, warmup: int) -> dict:
    """The timed steps of one run: each step's seconds (the difference of consecutive step ends, so
    setup and evals before the first step are left out), tokens and generate seconds, warm-up dropped."""
    ends = result["end_s"]
    step_s = [b - a for a, b in zip(ends, ends[1:])][warmup - 1:]  # step i's time: end i - end i-1, i >= warmup
    tokens, gen = result["tokens"][warmup:], result["generate_s"][warmup:]
    assert len(step_s) == len(tokens) == len(gen) > 0
    # medians of per-step values, both columns alike: a step stalled by another job on these cores is an outlier
    return {"s_per_step": statistics.median(step_s),
            "tokens_per_s": statistics.median(n / t for n, t in zip(tokens, step_s)),
            "tokens_per_step": sum(tokens) / len(tokens), "generate_s_per_step": statistics.median(gen),
            # the rest of the step: forward, backward and AdamW (ours also copies the weights to its engine)
            "update_s_per_step": statistics.median(t - g for t, g in zip(step_s, gen)), "step_s": step_s,
            "step_tokens": tokens}


# ----------------------------------------------------------------------------- the bench

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="runs per side, the sides alternating order")
    ap.add_argument("--steps", type=int, default=5, help="timed RL steps per run")
    # the second step of either side is still slower than the rest (allocator, caches), so two are dropped
    ap.add_argument("--warmup", type=int, default=2, help="RL steps per run before the timed ones (>= 1)")
    ap.add_argument("--vocab", default="small", choices=("small", "qwen"),
                    help=f"small: Qwen's first {SMALL_RANKS} ranks + 3 specials; qwen: all 151,643 (slow)")
    ap.add_argument("--data", default=os.path.normpath(os.path.join(ROOT, "..", "shared", "data")),
                    help="folder of gsm8k_train.jsonl and gsm8k_test.jsonl ('': made-up rows of that format, "
                         "as --smoke uses)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads of each side (1: on 2 shared cores two OpenMP threads stall each other)")
    ap.add_argument("--trl-microbatch", type=int, default=16, help="TRL rows per forward/backward (divides 64)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds one run may take before the bench fails")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = smoke.parse_args(ap, SMOKE)
    if args.child:
        return child(args.child)
    if args.warmup < 1 or args.steps < 1 or args.rounds < 1:
        raise ValueError(f"--warmup {args.warmup}, --steps {args.steps}, --rounds {args.rounds}: each must be >= 1")
    import torch
    import transformers
    import trl

    import hf_checkpoint
    if args.data:
        gsm8k_files(args.data)  # before any work
    if hf_checkpoint.qwen_ranks_path() is None:
        sys.exit("needs Qwen's vocabulary from dashscope: pip install -c <(echo torch==2.13.0) -r requirements-dev.txt")
    num_steps = args.warmup + args.steps
    work = tempfile.mkdtemp(prefix="bench_trl_")
    data = args.data or smoke_gsm8k(os.path.join(work, "data"), num_steps * PROMPTS_PER_STEP)
    ckpt = os.path.join(work, "ckpt")
    t = time.perf_counter()
    if args.vocab == "small":
        small_checkpoint(ckpt)
    else:
        hf_checkpoint.build_checkpoint(ckpt, "qwen3_moe")
    pool = prompt_pool(ckpt, data, num_steps * PROMPTS_PER_STEP, work)  # each run sees every row once
    same_ids = same_prompt_ids(ckpt, pool["messages"][0], pool["first_prompt_ids"])
    with open(os.path.join(ckpt, "config.json")) as f:
        model_cfg = json.load(f)
    print(f"checkpoint ({args.vocab} vocabulary, {model_cfg['vocab_size']} ids) and {len(pool['messages'])} GSM8K "
          f"prompts (median {statistics.median(pool['prompt_tokens'])} tokens) in {time.perf_counter() - t:.0f}s; "
          f"TRL's prompt ids {'match' if same_ids else 'DIFFER FROM'} this project's")
    job = {"ckpt": ckpt, "train": pool["train"], "eval": pool["eval"], "messages": pool["messages"],
           "golds": pool["golds"], "num_steps": num_steps, "threads": args.threads, "seed": args.seed,
           "trl_microbatch": args.trl_microbatch}

    load = [os.getloadavg()[0]]
    rounds = []
    for r in range(args.rounds):
        order = ("ours", "trl") if r % 2 == 0 else ("trl", "ours")  # alternate, so drift in load hits both alike
        this = {}
        for side in order:
            t = time.perf_counter()
            this[side] = per_step(run_side(side, job, os.path.join(work, f"{side}{r}"), args.timeout), args.warmup)
            this[side]["run_s"] = time.perf_counter() - t
            load.append(os.getloadavg()[0])
            print(f"round {r + 1}/{args.rounds} {side:<5} {this[side]['s_per_step']:.2f} s/step, "
                  f"{this[side]['tokens_per_s']:.0f} tokens/s (run {this[side]['run_s']:.0f}s)", flush=True)
        rounds.append(this)

    def summary(side, key):
        xs = [rd[side][key] for rd in rounds]
        return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}
    table = {side: {k: summary(side, k) for k in ("s_per_step", "tokens_per_s", "tokens_per_step",
                                                    "generate_s_per_step", "update_s_per_step")}
             for side in ("ours", "trl")}
    step_ratio = [rd["trl"]["s_per_step"] / rd["ours"]["s_per_step"] for rd in rounds]
    token_ratio = [rd["ours"]["tokens_per_s"] / rd["trl"]["tokens_per_s"] for rd in rounds]
    ratios = {"s_per_step": {"median": statistics.median(step_ratio), "min": min(step_ratio), "max": max(step_ratio)},
              "tokens_per_s": {"median": statistics.median(token_ratio), "min": min(token_ratio),
                               "max": max(token_ratio)}}

    print(f"\n{PROMPTS_PER_STEP} prompts x {GROUP_SIZE} rollouts x <= {MAX_NEW_TOKENS} new tokens per RL step, "
          f"{args.vocab} vocabulary ({model_cfg['vocab_size']} ids), fp32, {args.threads} threads; {args.steps} "
          f"timed steps per run after {args.warmup} warm-up, median [min-max] of {args.rounds} rounds")
    names = {"ours": "this project (train.py)", "trl": f"TRL {trl.__version__} GRPOTrainer"}
    print(f"{'side':<28}{'s/step':>20}{'tokens/s':>18}{'tokens/step':>13}{'generate+score s':>18}{'update s':>10}")

    def cell(s, fmt):
        return f"{s['median']:{fmt}} [{s['min']:{fmt}}-{s['max']:{fmt}}]"
    for side, row in table.items():
        print(f"{names[side]:<28}{cell(row['s_per_step'], '.2f'):>20}{cell(row['tokens_per_s'], '.0f'):>18}"
              f"{row['tokens_per_step']['median']:>13.0f}{row['generate_s_per_step']['median']:>18.2f}"
              f"{row['update_s_per_step']['median']:>10.2f}")
    print(f"{'ratio (per round)':<28}{cell(ratios['s_per_step'], '.2f'):>20}{cell(ratios['tokens_per_s'], '.2f'):>18}")

    busy = max(load) > os.cpu_count()
    with open(smoke.results_path(args, "trl"), "w") as f:
        json.dump({"config": {k: v for k, v in vars(args).items() if k != "child"},
                   "work": {"prompts_per_step": PROMPTS_PER_STEP, "group_size": GROUP_SIZE,
                            "max_new_tokens": MAX_NEW_TOKENS, "lr": LR, "max_prompt_tokens": MAX_PROMPT_TOKENS,
                            "prompt_tokens_median": statistics.median(pool["prompt_tokens"])},
                   "model": {k: model_cfg[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                                                       "num_local_experts", "num_experts", "moe_intermediate_size",
                                                       "num_experts_per_tok") if k in model_cfg},
                   "same_prompt_ids": same_ids, "trl_version": trl.__version__,
                   "transformers_version": transformers.__version__, "torch_version": torch.__version__,
                   "cpu_count": os.cpu_count(), "load_average_1min": load,
                   "note": (f"contended: the 1-minute load average reached {max(load):.1f} on {os.cpu_count()} CPUs, "
                            f"so absolute times are inflated and noisy; each round's two runs are adjacent, so the "
                            f"per-round ratios are the numbers to read" if busy else "quiet machine"),
                   "sides": table, "ratio": ratios, "rounds": rounds}, f, indent=1)
    print(f"{ratios['tokens_per_s']['median']:.2f}x RL step throughput vs TRL GRPOTrainer (generated tokens/s, "
          f"median of {args.rounds} rounds, {ratios['tokens_per_s']['min']:.2f}-{ratios['tokens_per_s']['max']:.2f}; "
          f"{ratios['s_per_step']['median']:.2f}x per RL step; {args.vocab} vocabulary; target 3x)")
    shutil.rmtree(work)  # kept when a run fails: the message names its job file there


if __name__ == "__main__":
    main()
