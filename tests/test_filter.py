"""The three zero-variance stages and the per-step driver, with a scripted sampler in place of a model."""

import json
import random

import pytest
import torch

from filter import (OFFLINE_WEIGHT, PromptHistory, PromptRecord, Scored, StageConfig, collect_groups, post_rollout_filter,
                    pre_rollout_filter, probe_rollouts, rest_agree_probability, zvp_token_advantages)


class ScriptedSampler:
    """Prompt p's j-th rollout gets reward script[p][j % len(script[p])] and 10 tokens; records each call's n."""

    def __init__(self, script: dict):
        self.script, self.calls, self.seen = script, [], {}

    def __call__(self, prompts, n):
        self.calls.append((list(prompts), n))
        out = []
        for p in prompts:
            start = self.seen.get(p, 0)
            self.seen[p] = start + n
            out.append([Scored(self.script[p][(start + j) % len(self.script[p])], 10, (p, start + j)) for j in range(n)])
        return out


def test_skip_probability_is_zero_for_unseen_or_informative_prompts_and_halves_every_half_life():
    h = PromptHistory()
    h.observe("easy", 1.0, step=10)
    h.observe("hard", 0.0, step=10)
    h.observe("mixed", 0.5, step=10)
    kw = dict(skip_prob=0.8, half_life=5.0)
    assert h.skip_probability("unseen", 10, **kw) == 0.0 and h.skip_probability("mixed", 10, **kw) == 0.0
    assert h.skip_probability("easy", 10, **kw) == 0.8
    assert h.skip_probability("hard", 15, **kw) == pytest.approx(0.4)
    assert h.skip_probability("hard", 60, **kw) < 0.001  # it comes back


def test_pre_rollout_filter_skips_recent_zero_variance_prompts_and_counts_the_savings():
    h = PromptHistory()
    h.observe("a", 1.0, step=3)
    h.observe("b", 0.25, step=3)
    keep, stats = pre_rollout_filter(["a", "b", "c"], h, 3, skip_prob=1.0, half_life=10.0, rng=random.Random(0),
                                     group_size=8, predicted_tokens=[5.0, 7.0, 9.0])
    assert keep == [False, True, True]
    assert stats == {"prompts_skipped": 1, "rollouts_saved": 8, "tokens_saved_est": 40.0}


def test_a_prompt_drawn_many_times_is_skipped_with_its_skip_probability_not_that_to_the_power_of_its_visits():
    h, rng = PromptHistory(), random.Random(0)
    keys = [f"q{i}" for i in range(2000)]
    for k in keys:
        h.observe(k, 0.0, step=0)
    kw = dict(skip_prob=1.0, half_life=1.0, rng=rng, group_size=8, predicted_tokens=[1.0] * len(keys))
    visits = [pre_rollout_filter(keys, h, 1, **kw)[0] for _ in range(5)]  # five draws of every prompt at step 1
    assert all(v == visits[0] for v in visits)  # one decision per record, not one per visit
    assert sum(not kept for kept in visits[0]) / len(keys) == pytest.approx(0.5, abs=0.04)  # 2^(-1/1)
    later = pre_rollout_filter(keys, h, 2, **kw)[0]  # the probability decays: a prompt back at step 1 stays back
    assert all(k2 for k1, k2 in zip(visits[0], later) if k1) and sum(not k for k in later) / len(keys) == pytest.approx(0.25, abs=0.04)
    h.observe("q0", 1.0, step=2)  # a new observation gets a new draw
    assert h.records["q0"].draw is None


def test_offline_pass_rates_are_applied_once_and_bad_rows_rejected(tmp_path):
    path = tmp_path / "rates.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [{"id": "q1", "pass_rate": 1.0}, {"id": "q2", "pass_rate": 0.3}]))
    h = PromptHistory()
    assert h.load_offline(str(path)) == 2
    assert h.skip_probability("q1", 0, skip_prob=0.5, half_life=1.0) == 0.5
    assert h.skip_probability("q2", 0, skip_prob=0.5, half_life=1.0) == 0.0
    path.write_text(json.dumps({"id": "q3", "pass_rate": 1.5}))
    with pytest.raises(ValueError, match="pass_rate"):
        h.load_offline(str(path))


def test_probes_that_agree_stop_the_prompt_and_the_others_get_the_rest_of_their_group():
    sampler = ScriptedSampler({"easy": [1.0], "hard": [0.0], "mixed": [1.0, 0.0]})
    groups, stats = probe_rollouts(["easy", "hard", "mixed"], sampler, group_size=8, probe_size=2)
    assert sampler.calls == [(["easy", "hard", "mixed"], 2), (["mixed"], 6)]
    assert [len(g) for g in groups] == [2, 2, 8]
    assert [s.payload for s in groups[2]] == [("mixed", j) for j in range(8)]  # probes first, in order
    assert stats == {"prompts_stopped": 2, "rollouts_saved": 12, "tokens_saved_est": 120.0, "rollouts_added": 0}


def test_informative_prompts_can_get_an_enlarged_group():
    sampler = ScriptedSampler({"easy": [1.0], "mixed": [1.0, 0.0]})
    groups, stats = probe_rollouts(["easy", "mixed"], sampler, group_size=4, probe_size=2, enlarged_size=6)
    assert [len(g) for g in groups] == [2, 6] and stats["rollouts_added"] == 2


@pytest.mark.parametrize("probe_size, enlarged", [(1, 0), (8, 0), (0, 12), (2, 6)])
def test_bad_probe_settings_are_value_errors(probe_size, enlarged):
    with pytest.raises(ValueError):
        probe_rollouts(["p"], ScriptedSampler({"p": [1.0]}), group_size=8, probe_size=probe_size, enlarged_size=enlarged)


def test_with_every_stage_off_the_driver_samples_each_prompt_once_with_a_full_group():
    sampler = ScriptedSampler({p: [0.0] for p in "abc"})
    groups, counts = collect_groups(list("abc"), sampler, PromptHistory(), 0, StageConfig(group_size=4), key=str,
                                    predicted_tokens=lambda p: 1.0, rng=random.Random(0), draw=lambda n: list("xyz"))
    assert sampler.calls == [(list("abc"), 4)]
    assert [p for p, _ in groups] == list("abc") and counts["groups_informative"] == 0


def test_over_sampling_draws_prompts_until_the_batch_has_its_informative_groups():
    script = {f"p{i}": ([1.0, 0.0] if i % 2 else [0.0]) for i in range(40)}  # every other prompt is informative
    fresh = iter(sorted(script, key=lambda k: int(k[1:]))[4:])
    drawn = []

    def draw(n):
        drawn.append(n)
        return [next(fresh) for _ in range(n)]

    cfg = StageConfig(group_size=4, probe_size=2, oversample_rounds=3)
    groups, counts = collect_groups(["p0", "p1", "p2", "p3"], ScriptedSampler(script), PromptHistory(), 0, cfg,
                                    key=str, predicted_tokens=lambda p: 1.0, rng=random.Random(0), draw=draw)
    assert counts["groups_informative"] >= 4 and counts["oversample_rounds"] == 1
    assert drawn == [4]  # 2 informative of 4 drawn: 2 missing at rate 1/2
    assert counts["prompts_drawn"] == 8 and counts["stage2_prompts_stopped"] == 4


def test_history_from_one_step_makes_stage_one_skip_the_next():
    script = {"easy": [1.0], "mixed": [1.0, 0.0]}
    history, cfg = PromptHistory(), StageConfig(group_size=4, skip_prob=1.0, skip_half_life=100.0)
    args = dict(key=str, predicted_tokens=lambda p: 3.0, rng=random.Random(0))
    collect_groups(["easy", "mixed"], ScriptedSampler(script), history, 0, cfg, **args)
    sampler = ScriptedSampler(script)
    groups, counts = collect_groups(["easy", "mixed"], sampler, history, 1, cfg, **args)
    assert sampler.calls == [(["mixed"], 4)]
    assert counts["stage1_prompts_skipped"] == 1 and counts["stage1_tokens_saved_est"] == 12.0


def test_agreeing_probes_stop_a_prompt_unless_its_history_makes_the_rest_likely_to_differ():
    script = {"was_mixed": [1.0, 1.0, 0.0, 0.0], "unseen": [1.0, 1.0, 0.0, 0.0]}  # the first two probes agree
    history = PromptHistory()
    history.observe("was_mixed", 0.5, step=0, n=4)
    sampler = ScriptedSampler(script)
    groups, counts = collect_groups(["was_mixed", "unseen"], sampler, history, 1, StageConfig(group_size=4, probe_size=2),
                                    key=str, predicted_tokens=lambda p: 1.0, rng=random.Random(0))
    assert [len(g) for _, g in groups] == [4, 2] and counts["stage2_prompts_stopped"] == 1
    assert history.records["unseen"].n == 2 and history.records["was_mixed"].n == 4


def test_rest_agree_probability_is_the_beta_posterior_predictive():
    # no history: Beta(1/2 + k, 1/2); E[q^m] = prod (a + i) / (a + b + i)
    assert rest_agree_probability(0.0, 4, 4, None) == pytest.approx(4.5 / 5 * 5.5 / 6 * 6.5 / 7 * 7.5 / 8)
    assert all(rest_agree_probability(1.0, k, 8 - k, None) > 0.5 for k in range(2, 8))  # new prompts stop at 0.5
    # a last group of 1 correct in 8, then 4 wrong probes: Beta(1/2 + 1, 1/2 + 7 + 4)
    one_in_8 = PromptRecord(1 / 8, 0, 8)
    assert rest_agree_probability(0.0, 4, 4, one_in_8) == pytest.approx(11.5 / 13 * 12.5 / 14 * 13.5 / 15 * 14.5 / 16)
    # the same history makes 4 correct probes' agreement with 4 more correct unlikely
    assert rest_agree_probability(1.0, 4, 4, one_in_8) < 0.1 < 0.5 < rest_agree_probability(0.0, 4, 4, one_in_8)
    half = PromptRecord(0.5, 0, 8)
    assert rest_agree_probability(0.0, 4, 4, half) == pytest.approx(rest_agree_probability(1.0, 4, 4, half))
    assert rest_agree_probability(0.0, 4, 4, half) < 0.5


@pytest.mark.parametrize("threshold", [-0.1, 1.5])
def test_stop_threshold_outside_unit_interval_is_refused(threshold):
    with pytest.raises(ValueError, match="stop_threshold"):
        StageConfig(group_size=8, probe_size=4, stop_threshold=threshold)
    with pytest.raises(ValueError, match="stop_threshold"):
        probe_rollouts(["p"], ScriptedSampler({"p": [1.0]}), group_size=8, probe_size=4, stop_threshold=threshold)


def test_history_state_dict_round_trips_and_reads_older_two_field_records():
    h = PromptHistory()
    h.observe("a", 0.25, step=3, n=8)
    h2 = PromptHistory()
    h2.load_state_dict(h.state_dict())
    assert h2.records == h.records
    h2.load_state_dict({"records": {"old": (1.0, 7)}})
    assert h2.records["old"] == PromptRecord(1.0, 7, OFFLINE_WEIGHT)


def test_post_rollout_filter_handles_groups_of_different_sizes():
    rewards = [torch.tensor([1.0, 1.0]), torch.tensor([0.0, 1.0, 0.0, 1.0]), torch.tensor([0.0, 0.0, 0.0])]
    lengths = [torch.tensor([3, 4]), torch.tensor([1, 1, 1, 1]), torch.tensor([2, 2, 2])]
    keep, stats = post_rollout_filter(rewards, lengths, correct_PG=rewards)
    assert keep.tolist() == [False, True, False]
    assert stats["all_correct"] == 1 and stats["all_wrong"] == 1
    assert stats["rollouts_dropped"] == 5 and stats["tokens_dropped"] == 13


def test_rl_zvp_rewards_confident_wrong_tokens_least_and_uncertain_correct_tokens_most():
    h = torch.tensor([0.5, 2.0, 1.0])
    assert zvp_token_advantages(h, correct=True, alpha=0.1).tolist() == pytest.approx([0.05, 0.2, 0.1])
    assert zvp_token_advantages(h, correct=False, alpha=0.1).tolist() == pytest.approx([-0.15, 0.0, -0.1])
    with pytest.raises(ValueError):
        zvp_token_advantages(h, correct=True, alpha=-1.0)
