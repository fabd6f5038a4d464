"""The RL step's reward shaping by a reward model or a generative judge (reward.model): `shape_rewards`, each
group's rewards moved inside its correctness class by the scorer's outputs and checked against inversion, and
`judge_generator`, the native engine a judge generates on. train.collect_rollouts calls the first when
reward.shapes; train.start_run builds the scorer with the second (reward_model.reward_model_for).

Notable choices:
1. Under torchrun each rank's whole scorer scores the groups it generated (reward_model.py's choice 8) and
   every rank learns every group's scores (all_gather_list), so all ranks shape alike.
2. Every group is checked, every step, to keep each correct response's reward above each wrong one's
   (reward.adjust_rewards' guarantee, arXiv 2512.07710's adjustment against advantage inversion): a broken
   guarantee stops the run naming the step and group, before a step trains on it.
"""

from __future__ import annotations

import time

import torch

from distributed import all_gather_list, rank_world
from evaluation import completion_text
from reward import order_violations, scorer_outputs, shaped_rewards
from rollout import NativeEngine
from sampler import Rollout, SamplingParams
from weights import policy_tensors

JUDGE_SEED = 0  # a generative judge decodes greedily; a fixed seed keeps its calls off torch's RNG (the policy's)


def shape_rewards(run, groups, correct: list[torch.Tensor], step: int) -> tuple[list[torch.Tensor], dict]:
    """run: the train.Run of the step (its cfg, scorer and tokenizer); groups: its (item, [Scored]) pairs. Each
    group's final rewards, shaped inside its correctness class (reward.shaped_rewards), and their metrics:
    the scorer's raw outputs (rm/score_mean and rm/score_std, or a judge's judge/p_better_mean and its counts:
    judge/unparsed, judge/too_long), the rewards' mean and std, the (correct, wrong) pairs checked and
    t_reward_model (the scorer's seconds). Every group is checked to keep each correct response's reward above
    each wrong one's (reward.adjust_rewards' guarantee): an AssertionError naming the step if one ever is not.
    With reward.rm_only the verifier's correctness is unread: each group is one class, the check vacuous.
    Multi-rank: each rank's whole scorer scores the groups it generated (a group is generated on one rank), and
    every rank learns every group's scores and the judge's counts (summed), so all shape alike; t_reward_model
    is this rank's, the wait for the slowest rank's scoring included."""
    cfg, scorer = run.cfg.reward, run.scorer
    t0 = time.perf_counter()
    scores = [None] * len(groups)
    if scorer is not None:
        world = rank_world()[1]
        # this rank's groups: their rollouts are whole here (Rollout), the others' are summaries
        mine = [p for p, (_, g) in enumerate(groups) if world == 1 or isinstance(g[0].payload, Rollout)]
        own = [(p, scorer_outputs(scorer, groups[p][0].question,
                                  [completion_text(run.tok, s.payload) for s in groups[p][1]], groups[p][0].answer))
               for p in mine]
        for p, x in all_gather_list(own):  # every rank's, rank order; one process: its own
            scores[p] = x
        counts = all_gather_list([dict(scorer.counts)]) if hasattr(scorer, "counts") else []
    m = {"t_reward_model": time.perf_counter() - t0}
    classes = [torch.zeros_like(c) for c in correct] if cfg.rm_only else correct
    rewards = [shaped_rewards(c, [s.payload.completion_ids for s in g], cfg, scorer=scorer, scores=x,
                              max_new_tokens=run.cfg.sampling.max_new_tokens)
               for (_, g), c, x in zip(groups, classes, scores)]
    pairs = 0
    for p, (c, r) in enumerate(zip(classes, rewards)):
        n, inverted = order_violations(c, r)
        if inverted:  # adjust_rewards rules this out; a change to the shaping that breaks it must not train on
            raise AssertionError(f"step {step}: group {p}: {inverted} of {n} (correct, wrong) pairs have the wrong "
                                 f"response's reward at or above the correct one's: rewards {r.tolist()}, correct "
                                 f"{c.tolist()} (reward.adjust_rewards' ordering guarantee broken)")
        pairs += n
    if rewards:
        r = torch.cat(rewards).double()
        m.update({"reward/shaped_mean": r.mean().item(), "reward/shaped_std": r.std(correction=0).item()})
    m.update({"reward/order_pairs_checked": pairs, "reward/order_violations": 0})
    if scorer is not None and scores:
        x = torch.cat(scores)
        if hasattr(scorer, "compare"):
            m["judge/p_better_mean"] = x.mean().item()
        else:
            m.update({"rm/score_mean": x.mean().item(), "rm/score_std": x.std(correction=0).item()})
    if hasattr(scorer, "counts"):  # a GenerativeJudge's: this step's over every rank, then reset
        m.update({f"judge/{k}": sum(c[k] for c in counts) for k in scorer.counts})
        scorer.counts.subtract(dict(scorer.counts))
    return rewards, m


def judge_generator(cfg):
    """cfg: the run's config.TrainConfig. How a generative judge (reward.model=judge:<folder>) generates: builder(model, tok) -> a greedy generator on
    a NativeEngine of its own holding the judge's weights (cfg.device, the run's compute dtype), replies of at most
    reward.judge_max_new_tokens, their stop token left out. Under torchrun each rank holds a whole judge, which
    judges the groups that rank generated (shape_rewards)."""
    def build(model, tok):
        engine = NativeEngine(model.cfg, eos_id=tok.stop_ids, pad_id=tok.pad_id, device=cfg.device,
                              dtype=cfg.compute_dtype(), num_tokens=tok.enc.n_vocab)
        engine.update_weights(policy_tensors(model), version=0)
        params = SamplingParams(max_new_tokens=cfg.reward.judge_max_new_tokens, temperature=0.0)

        def generate(prompts: list[list[int]]) -> list[list[int]]:
            replies = engine.generate(prompts, params, seed=JUDGE_SEED)
            return [r.completion_ids[:-1] if r.finish_reason == "stop" else r.completion_ids for r in replies]
        return generate
    return build
