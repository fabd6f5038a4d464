"""The three zero-variance stages as pure decisions, and train.collect_rollouts driving them with a scripted verifier."""

import json
import random

import pytest
import torch

import train
from config import load_config
from filter import (OFFLINE_WEIGHT, FilterConfig, PromptHistory, PromptRecord, Scored, post_rollout_filter, stage3,
                    pre_rollout_filter, probe_decisions, rest_agree_probability)
from data import Item, Task
from espo import zvp_token_advantages
from runs import make_run, micro_config


class ScriptedTask(Task):
    """Prompts named by the script's keys; prompt p's j-th scored rollout gets reward script[p][j % len(script[p])]."""

    def __init__(self, script: dict):
        self.script, self.seen = script, {}
        self.items = [Item(p, "0", 0, i) for i, p in enumerate(script)]

    def score(self, completion, item):
        j = self.seen.get(item.question, 0)
        self.seen[item.question] = j + 1
        return self.script[item.question][j % len(self.script[item.question])]


def scripted_run(tmp_path, script: dict, overrides=()):
    """A Run over the script's prompts (in order), recording each engine call's (sorted prompts, n)."""
    run = make_run(micro_config(tmp_path, [f"prompts_per_step={len(script)}", "gen_batch_rows=1024", *overrides]),
                   ScriptedTask(script))
    calls, generate = [], run.engine.generate

    def recording(prompts, params, *, n=1, seed=None, group_ids=None):
        calls.append((sorted(run.tok.decode(p[1:]).strip() for p in prompts), n))  # prompt texts, without BOS and newline
        return generate(prompts, params, n=n, seed=seed, group_ids=group_ids)

    run.engine.generate = recording
    return run, calls


def scored(rewards: list[float], tokens: int = 10) -> list[Scored]:
    return [Scored(r, tokens) for r in rewards]


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
    cfg = FilterConfig(skip_prob=1.0, skip_half_life=10.0)
    keep, stats = pre_rollout_filter(["a", "b", "c"], h, 3, cfg, group_size=8, rng=random.Random(0),
                                     predicted_tokens=[5.0, 7.0, 9.0])
    assert keep == [False, True, True]
    assert stats == {"prompts_skipped": 1, "rollouts_saved": 8, "tokens_saved_est": 40.0}


def test_a_prompt_drawn_many_times_is_skipped_with_its_skip_probability_not_that_to_the_power_of_its_visits():
    h, rng = PromptHistory(), random.Random(0)
    keys = [f"q{i}" for i in range(2000)]
    for k in keys:
        h.observe(k, 0.0, step=0)
    cfg = FilterConfig(skip_prob=1.0, skip_half_life=1.0)
    kw = dict(group_size=8, rng=rng, predicted_tokens=[1.0] * len(keys))
    visits = [pre_rollout_filter(keys, h, 1, cfg, **kw)[0] for _ in range(5)]  # five draws of every prompt at step 1
    assert all(v == visits[0] for v in visits)  # one decision per record, not one per visit
    assert sum(not kept for kept in visits[0]) / len(keys) == pytest.approx(0.5, abs=0.04)  # 2^(-1/1)
    later = pre_rollout_filter(keys, h, 2, cfg, **kw)[0]  # the probability decays: a prompt back at step 1 stays back
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


def test_probes_that_agree_stop_the_prompt_and_the_others_get_the_rest_of_their_group(tmp_path):
    cfg = FilterConfig(probe_size=2)
    go_on, stats = probe_decisions([scored([1.0, 1.0]), scored([0.0, 0.0]), scored([1.0, 0.0])], [None] * 3, cfg,
                                   group_size=8)
    assert go_on == [2]
    assert stats == {"prompts_stopped": 2, "rollouts_saved": 12, "tokens_saved_est": 120.0, "rollouts_added": 0}
    run, calls = scripted_run(tmp_path, {"easy": [1.0], "hard": [0.0], "mixed": [1.0, 0.0]},
                              ["group_size=8", "filter.probe_size=2"])
    m, batch = train.collect_rollouts(run, 0)
    assert calls == [(["easy", "hard", "mixed"], 2), (["mixed"], 6)]
    assert m["filter/rollouts_generated"] == 2 + 2 + 8 and m["filter/stage2_prompts_stopped"] == 2
    assert len(batch.seqs) == 8  # stage 3 drops the two stopped groups of two probes


def test_informative_prompts_can_get_an_enlarged_group(tmp_path):
    run, calls = scripted_run(tmp_path, {"easy": [1.0], "mixed": [1.0, 0.0]},
                              ["filter.probe_size=2", "filter.enlarged_group_size=6"])
    m, _ = train.collect_rollouts(run, 0)
    assert calls == [(["easy", "mixed"], 2), (["mixed"], 4)]
    assert m["filter/rollouts_generated"] == 2 + 6 and m["filter/stage2_rollouts_added"] == 2


@pytest.mark.parametrize("probe_size, enlarged, refused", [(1, 0, "probe_size=1"), (8, 0, "probe_size=8"),
                                                             (0, 12, "enlarged_group_size=12"),
                                                             (2, 6, "enlarged_group_size=6")])
def test_bad_probe_settings_are_value_errors(tmp_path, probe_size, enlarged, refused):
    # FilterConfig refuses what needs no group size (one probe, enlarging without probes); config.RELATIONS refuses
    # the settings that do not fit group_size=8 (probes of the whole group, an "enlarged" group smaller than it)
    if (probe_size, enlarged) in ((1, 0), (0, 12)):
        with pytest.raises(ValueError, match=refused):
            FilterConfig(probe_size=probe_size, enlarged_group_size=enlarged)
    with pytest.raises(ValueError, match=rf"filter\.{refused}:"):
        load_config(None, [f"filter.probe_size={probe_size}", f"filter.enlarged_group_size={enlarged}", "group_size=8",
                           f"out_dir={tmp_path / 'run'}"])


def test_with_every_stage_off_the_driver_samples_each_prompt_once_with_a_full_group(tmp_path):
    run, calls = scripted_run(tmp_path, {p: [0.0] for p in "abc"})
    m, batch = train.collect_rollouts(run, 0)
    assert calls == [(list("abc"), 4)]
    assert m["filter/groups_informative"] == 0 and batch is None


def test_over_sampling_draws_prompts_until_the_batch_has_its_informative_groups(tmp_path):
    script = {f"p{i}": ([1.0, 0.0] if i % 2 else [0.0]) for i in range(40)}  # every other prompt is informative
    run, calls = scripted_run(tmp_path, script, ["prompts_per_step=4", "filter.probe_size=2", "filter.oversample_rounds=3"])
    m, _ = train.collect_rollouts(run, 0)
    assert m["filter/groups_informative"] >= 4 and m["filter/oversample_rounds"] == 1
    # probes of the 4 drawn, the rest of the 2 informative; 2 missing at rate 1/2: 4 more drawn, and so on
    assert [len(p) for p, _ in calls] == [4, 2, 4, 2]
    assert m["filter/prompts_drawn"] == 8 and m["filter/stage2_prompts_stopped"] == 4


def test_history_from_one_step_makes_stage_one_skip_the_next(tmp_path):
    run, calls = scripted_run(tmp_path, {"easy": [1.0], "mixed": [1.0, 0.0]},
                              ["filter.skip_prob=1.0", "filter.skip_half_life=100.0"])
    train.collect_rollouts(run, 0)
    calls.clear()
    m, _ = train.collect_rollouts(run, 1)  # the same two prompts again: the task's order cycles
    assert calls == [(["mixed"], 4)]
    easy = run.prompts.task[0]
    predicted = run.predictor.predict(easy.question, task=easy.task, prompt_len=len(run.prompts.ids[easy.question]))
    assert m["filter/stage1_prompts_skipped"] == 1 and m["filter/stage1_tokens_saved_est"] == 4 * predicted


def test_agreeing_probes_stop_a_prompt_unless_its_history_makes_the_rest_likely_to_differ(tmp_path):
    script = {"was_mixed": [1.0, 1.0, 0.0, 0.0], "unseen": [1.0, 1.0, 0.0, 0.0]}  # the first two probes agree
    run, calls = scripted_run(tmp_path, script, ["filter.probe_size=2"])
    run.history.observe("was_mixed", 0.5, step=0, n=4)
    m, _ = train.collect_rollouts(run, 1)
    assert calls == [(["unseen", "was_mixed"], 2), (["was_mixed"], 2)] and m["filter/stage2_prompts_stopped"] == 1
    assert run.history.records["unseen"].n == 2 and run.history.records["was_mixed"].n == 4


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
    with pytest.raises(ValueError, match="probe_stop_threshold"):
        FilterConfig(probe_size=4, probe_stop_threshold=threshold)


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
    with pytest.raises(ValueError, match="zvp_alpha"):  # a negative alpha is refused where it is set
        FilterConfig(zvp_alpha=-1.0)


@pytest.mark.parametrize("line", ['{"id": "q", "pass_rate": "0.5"}', '{"id": "q", "pass_rate": true}',
                                  '{"id": "q", "pass_rate": 1.5}', '{"pass_rate": 0.5}', '{"id": "q"',
                                  '[1, 2]', '{"id": "q", "pass_rate": NaN}'],
                         ids=["string", "bool", "above-1", "no-id", "bad-json", "not-an-object", "nan"])
def test_offline_pass_rates_name_the_file_and_line_of_a_bad_row(tmp_path, line):
    path = tmp_path / "rates.jsonl"
    path.write_text('{"id": "ok", "pass_rate": 0.25}\n' + line + "\n")
    with pytest.raises(ValueError, match=f"{path} line 2"):
        PromptHistory().load_offline(str(path))


def test_stage3_drops_zero_variance_groups_or_with_rl_zvp_keeps_and_marks_them():
    rewards = [torch.tensor([1.0, 1.0]), torch.tensor([0.0, 1.0]), torch.tensor([0.0, 0.0, 0.0])]
    lengths = [torch.tensor([3, 4]), torch.tensor([5, 6]), torch.tensor([1, 2, 3])]
    keep, zero_var, counts = stage3(rewards, lengths, rewards, FilterConfig())
    assert keep.tolist() == [False, True, False] and zero_var.tolist() == [True, False, True]
    assert (counts["groups_dropped"], counts["rollouts_dropped"], counts["tokens_dropped"]) == (2, 5, 13)
    keep, zero_var, counts = stage3(rewards, lengths, rewards, FilterConfig(zero_variance="rl-zvp"))
    assert keep.all() and zero_var.tolist() == [True, False, True]  # kept, and marked for token advantages
    assert (counts["zvp_groups"], counts["groups_dropped"], counts["rollouts_dropped"]) == (2, 0, 0)
