"""Train-inference mismatch of FP8 rollouts, with router replay (R3) on and off, same run.

The rollout engine holds the policy in blockwise FP8 (e4m3, one scale per 128x128 block
of each attention and expert matrix, quantised on the trainer side: `quantize_fp8`);
the trainer holds it in bf16 or fp32. On the engine's own samples, the trainer's
logprobs of the sampled tokens are computed twice: routing freely (its own top-k) and
replaying the engine's recorded expert ids (R3, arXiv 2510.11370). Reported per trainer
precision (`espo.mismatch_metrics`): KL(pi_infer || pi_trainer) (k3 estimate over
sampled tokens), max and mean |delta logp|, and the fraction of (token, MoE layer) routes
where the trainer's own top-k set differs from the engine's (0 under replay, by
construction). Control rows: a bf16 engine against the fp32 trainer (finer rounding than
FP8, so routing's share of the gap shows), and an fp32 engine against the fp32 trainer.

Each row also splits the KL between the completion tokens predicted at a position where
the free-routing trainer flipped some layer's expert set and the rest: replay acts on the
former only, so when FP8 weight rounding (present on every token) dominates the KL, the
overall ratio stays small even where replay removes the routing part.

The model is the tiny config's after its SFT warm-up (trained routing, not random init):
`--init_from` a train.py output dir (`python train.py configs/tiny.py rl_steps=0
out_dir=/tmp/tiny_sft`), or, without it, `--sft_steps` of SFT run here first.
The seed paper reports replay taking the log-prob gap from about 1e-3 to 1e-4.

    python bench/mismatch.py [--init_from /tmp/tiny_sft --prompts 64 --samples 4 --threads 2] [--smoke] [--out PATH]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import random
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import train  # noqa: E402
from config import load_config  # noqa: E402
from espo import mismatch_metrics  # noqa: E402
from hf import load_hf  # noqa: E402
from model import Transformer  # noqa: E402
from data import Prompts, TaskMix, prompt_ids, run_tokenizer  # noqa: E402
from sampler import Vocab
from rollout import NativeEngine  # noqa: E402
from scheduler import LengthPredictor  # noqa: E402
from weights import policy_tensors, quantize_fp8  # noqa: E402
from tokenizer import Tokenizer, load_hf_tokenizer  # noqa: E402
from bench import smoke  # noqa: E402  (bench/smoke.py)

# --smoke: one SFT step, 2 prompts x 2 rollouts per engine; one thread (two stall each other on busy shared cores)
SMOKE = {"sft_steps": 1, "prompts": 2, "samples": 2, "threads": 1}


def load_policy(args):
    """(model fp32, tokenizer, train config, prompts) of the tiny run after SFT."""
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.py"), ["ckpt_every=0"])
    task = TaskMix(cfg.tasks, seed=cfg.train_seed, size=cfg.train_size)
    torch.manual_seed(cfg.seed)
    model = Transformer(cfg.model)
    if args.init_from:
        tok = load_run_output(args.init_from, model)
    else:
        print(f"no --init_from: running {args.sft_steps} SFT steps first")
        tok = run_tokenizer(cfg, task)  # the demo's own BPE, learned from the task as a run learns it
        cfg = dataclasses.replace(cfg, sft_steps=args.sft_steps)
        sft_here(cfg, task, tok, model, make_engine(cfg, tok))
    held_out = TaskMix(cfg.tasks, seed=cfg.eval_seed, size=args.prompts)  # prompts the SFT never saw
    prompts = [prompt_ids(tok, held_out, held_out[i], cfg.system_prompt) for i in range(args.prompts)]
    return model.eval().requires_grad_(False), tok, cfg, prompts


def sft_here(cfg, task, tok, model, engine):
    """cfg.sft_steps of train.sft on `model` over the task's prompts in the run's order (bench/zve.py uses it too)."""
    order = torch.randperm(len(task), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    sft_run = train.Run(cfg=cfg, engine=engine, tok=tok, model=model,
                        prompts=Prompts(task, order, tok, cfg.prompt_limit(), cfg.system_prompt),
                        predictor=LengthPredictor(prior=cfg.sampling.max_new_tokens / 2),
                        filter_rng=random.Random(cfg.seed))
    train.sft(sft_run, train.sft_optimizer(model, cfg), 0)


def load_run_output(path: str, model: Transformer) -> Tokenizer:
    """An earlier train.py run's final model (the HF hub layout train.save_model writes) loaded into
    `model`, and its tokenizer."""
    if not os.path.exists(os.path.join(path, "tokenizer.json")):
        sys.exit(f"{path}: no train.py output there (config.json, model.safetensors and tokenizer.json "
                 f"in the HF hub layout); make one with `python train.py configs/tiny.py rl_steps=0 out_dir={path}`")
    load_hf(path, model)
    return load_hf_tokenizer(path)


def make_engine(cfg, tok, *, fp8: bool = False, dtype: torch.dtype = torch.float32) -> NativeEngine:
    """A rollout engine with the run's stop and pad ids and engine section, as train.start_run builds it
    (rollout.build_native_engine), in `dtype`; fp8: with blockwise-FP8 weights (engine.fp8)."""
    return NativeEngine(cfg.model, Vocab(tok.stop_ids, tok.pad_id, num_tokens=tok.enc.n_vocab, decode=tok.decode),
                        dtype=dtype, options=dataclasses.replace(cfg.engine, fp8=fp8))


@torch.no_grad()
def trainer_logprobs(model, rollouts, *, replay: bool, temperature: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per rollout: the trainer's log pi of each completion token [C] fp32 and its own routes [P+C-1, L, K],
    from the model's forward with targets (as the trainer computes them; bench/gpu.py uses it too)."""
    B, L, K = len(rollouts), model.cfg.num_moe_layers, model.cfg.top_k
    T = max(len(r.prompt_ids) + len(r.completion_ids) - 1 for r in rollouts)
    tokens_BT = torch.zeros(B, T + 1, dtype=torch.long)  # right padding: causal attention never sees it
    routes_BTLK = torch.full((B, T, L, K), -1, dtype=torch.int64)  # -1 rows route freely
    for i, r in enumerate(rollouts):
        seq = r.prompt_ids + r.completion_ids
        tokens_BT[i, :len(seq)] = torch.tensor(seq)
        routes_BTLK[i, :len(seq) - 1] = r.routes
    dev = next(model.parameters()).device
    (logp_BT, _), own = model(tokens_BT[:, :-1].to(dev), tokens_BT[:, 1:].to(dev), temperature=temperature,
                              routed_experts=routes_BTLK.to(dev) if replay else None, return_routes=True)
    out = []
    for i, r in enumerate(rollouts):
        P, n = len(r.prompt_ids), len(r.prompt_ids) + len(r.completion_ids) - 1
        out.append((logp_BT[i, P - 1:n].float().cpu(), own[i, :n].cpu()))
    return out


def flip_mask(r, own_TLK) -> torch.Tensor:
    """bool [C]: completion token c was predicted at a position where the trainer's own
    top-k set differs from the engine's in some MoE layer (the trainer routing freely)."""
    P = len(r.prompt_ids)
    a = r.routes[P - 1:].long().sort(-1).values  # (C, L, K) rows that predict the completion tokens
    b = own_TLK[P - 1:].long().sort(-1).values
    return (a != b).any(-1).any(-1)


def split_by_flip(rollouts, trainer_logp, flipped) -> dict[str, float]:
    """KL (k3) over the tokens predicted where routing flipped, and over the rest."""
    d = torch.cat([r.logprobs.double() - lp.double() for r, lp in zip(rollouts, trainer_logp)])
    f = torch.cat(flipped)
    k3 = torch.exp(-d) - 1 + d
    return {"flipped_token_frac": f.double().mean().item(),
            "kl_flipped_tokens": k3[f].mean().item() if f.any() else 0.0,
            "kl_other_tokens": k3[~f].mean().item() if (~f).any() else 0.0,
            "kl_share_of_flipped_tokens": (k3[f].sum() / k3.sum().clamp(min=1e-300)).item()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--init_from", "--init-from", default="", help="train.py output dir holding the SFT'd tiny model")
    ap.add_argument("--sft_steps", type=int, default=350, help="SFT steps run here when --init_from is not given")
    ap.add_argument("--prompts", type=int, default=128, help="held-out prompts")
    ap.add_argument("--samples", type=int, default=8, help="rollouts per prompt")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = smoke.parse_args(ap, SMOKE)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model, tok, cfg, prompts = load_policy(args)

    engines = {"fp8": make_engine(cfg, tok, fp8=True), "bf16": make_engine(cfg, tok, dtype=torch.bfloat16),
               "fp32": make_engine(cfg, tok)}
    engines["fp8"].update_weights(quantize_fp8(policy_tensors(model)), version=0)  # quantised on the trainer side
    engines["bf16"].update_weights(policy_tensors(model), version=0)
    engines["fp32"].update_weights(policy_tensors(model), version=0)
    trainers = {"bf16": copy.deepcopy(model).to(torch.bfloat16), "fp32": model}

    rows = {}
    # bf16 engine / fp32 trainer: rounding 16x finer than e4m3's, so routing's share of the gap shows
    for engine_name, trainer_name in (("fp8", "bf16"), ("fp8", "fp32"), ("bf16", "fp32"), ("fp32", "fp32")):
        rollouts = engines[engine_name].generate(prompts, cfg.sampling, n=args.samples, seed=args.seed)
        for replay in (False, True):
            got = trainer_logprobs(trainers[trainer_name], rollouts, replay=replay, temperature=cfg.sampling.temperature)
            m = mismatch_metrics([r.logprobs for r in rollouts], [lp for lp, _ in got],
                                 infer_routes=[r.routes for r in rollouts], trainer_routes=[own for _, own in got])
            if not replay:  # which completion tokens were predicted at a position whose routes flipped
                flipped = [flip_mask(r, own) for r, (_, own) in zip(rollouts, got)]
            m.update(split_by_flip(rollouts, [lp for lp, _ in got], flipped))
            rows[f"{engine_name} engine / {trainer_name} trainer / replay {'on' if replay else 'off'}"] = m

    print(f"tiny model after SFT ({args.init_from or f'{args.sft_steps} SFT steps here'}); {args.prompts} held-out prompts x "
          f"{args.samples} samples, T={cfg.sampling.temperature}, up to {cfg.sampling.max_new_tokens} new tokens; "
          f"{sum(len(r.completion_ids) for r in rollouts)} sampled tokens in the last batch")
    print(f"{'engine / trainer / replay':<40}{'KL':>10}{'max|dlogp|':>11}{'mean|dlogp|':>12}{'routes differ':>14}"
          f"{'KL flip tok':>12}{'KL other':>10}{'flip tok':>9}")
    for name, m in rows.items():
        print(f"{name:<40}{m['mismatch/kl']:>10.2e}{m['mismatch/max_abs_logp']:>11.2e}{m['mismatch/mean_abs_logp']:>12.2e}"
              f"{m['mismatch/route_diff']:>14.4f}{m['kl_flipped_tokens']:>12.2e}{m['kl_other_tokens']:>10.2e}"
              f"{m['flipped_token_frac']:>9.3f}")
    print("routes differ: fraction of (token, MoE layer) whose top-k set differs from the engine's; flip tok: completion "
          "tokens predicted where the free-routing trainer flipped some layer (the same tokens in the replay-on row)")
    ratios = {t: rows[f"fp8 engine / {t} trainer / replay off"]["mismatch/kl"]
              / max(rows[f"fp8 engine / {t} trainer / replay on"]["mismatch/kl"], 1e-30) for t in ("bf16", "fp32")}
    smoke.write_results(args, "mismatch", {
        "args": vars(args), "rows": rows, "kl_ratio_replay_off_over_on": ratios, "seconds": time.perf_counter() - t0,
        "load_average_1min": os.getloadavg()[0],
        "note": "CPU shared with other jobs while measured; KL values do not depend on timing"})
    print(f"{ratios['bf16']:.1f}x lower train-inference KL with router replay (FP8 rollouts, bf16 trainer; "
          f"{ratios['fp32']:.1f}x with an fp32 trainer; target >= 10x)")


if __name__ == "__main__":
    main()
