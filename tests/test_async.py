import json

import pytest
import torch

import train
from config import load_config
from runs import MICRO, ParityTask, make_run, micro_config


class CountingPrompts(train.Prompts):
    """Prompts that record how many each draw asked for."""

    def __init__(self, task, tok, max_tokens):
        super().__init__(task, list(range(len(task))), tok, max_tokens)
        self.drawn = []

    def draw(self, n):
        self.drawn.append(n)
        return super().draw(n)


def run_async(tmp_path, overrides):
    cfg = micro_config(tmp_path, ["sampling.temperature=1.5", "lr=1e-2"] + overrides)
    run = make_run(cfg)
    run.prompts = CountingPrompts(ParityTask(), run.tok, cfg.prompt_limit())
    before = {n: p.detach().clone() for n, p in run.model.named_parameters()}
    metrics = list(train.rl_loop_async(run))
    return cfg, run.model, run.engine, before, metrics, run.prompts.drawn


@pytest.mark.parametrize("k", [1, 2])
def test_async_rollouts_are_at_most_max_staleness_versions_old_and_the_policy_trains(tmp_path, k):
    cfg, model, engine, before, metrics, drawn = run_async(tmp_path, [f"max_staleness={k}", "rl_steps=5",
                                                                      "loss.tis_cap=2.0"])
    assert [m["step"] for m in metrics] == list(range(5))
    for s, m in enumerate(metrics):
        assert max(0, s - k) <= m["weight_version_min"] <= m["weight_version_max"] <= s
        assert 0 <= m["async/staleness_min"] <= m["async/staleness_max"] <= k
    assert metrics[1]["async/staleness_max"] >= 1  # step 1 is generated while step 0 trains
    assert drawn == [cfg.prompts_per_step] * 5  # every step's prompts drawn once, in step order
    trained = [m for m in metrics if "skipped_update" not in m]
    assert trained and all(m["trained_sequences"] > 0 and "loss" in m for m in trained)
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())
    # the caller's engine ends on the trainer's final weights
    assert engine.weight_version == 5
    for (n, p), (_, q) in zip(model.named_parameters(), engine.model.named_parameters()):
        assert torch.equal(p, q), n


def test_async_loop_runs_the_filter_stages_and_rl_zvp_on_the_producer(tmp_path):
    cfg, model, engine, before, metrics, drawn = run_async(tmp_path, [
        "max_staleness=1", "rl_steps=3", "filter.probe_size=2", "filter.enlarged_group_size=6",
        "filter.oversample_rounds=1", "filter.zero_variance=rl-zvp"])
    for m in metrics:
        assert "skipped_update" not in m and m["trained_sequences"] == m["filter/rollouts_generated"]
        assert m["filter/zvp_sequences"] >= 2 * m["filter/zvp_groups"]
    assert sum(drawn) >= 3 * cfg.prompts_per_step


def test_stale_rollouts_show_a_logprob_gap_that_tis_sees(tmp_path):
    metrics = run_async(tmp_path, ["max_staleness=1", "rl_steps=4", "loss.tis_cap=2.0"])[4]
    by_staleness = {}
    for m in metrics:
        if "skipped_update" not in m and m["async/staleness_min"] == m["async/staleness_max"]:
            by_staleness.setdefault(m["async/staleness_max"], []).append(m)
    # fresh rollouts: the engine's logprobs are the trainer's pi_old (router replay, same weights)
    assert all(m["mismatch/max_abs_logp"] <= 1e-5 for m in by_staleness.get(0, []))
    # one version old: pi_old is recomputed with the newer weights, so pi_infer differs and TIS reweights
    stale = by_staleness[1]
    assert all(m["mismatch/max_abs_logp"] > 1e-4 for m in stale)
    assert any(abs(m["loss/mismatch/is_weight_mean"] - 1) > 1e-5 for m in stale)


def test_a_producer_error_reaches_the_trainer(tmp_path):
    run = make_run(micro_config(tmp_path, ["max_staleness=1"]))

    def broken(*args, **kwargs):
        raise KeyError("engine fell over")
    run.engine.generate = broken
    with pytest.raises(KeyError, match="engine fell over"):
        list(train.rl_loop_async(run))


def test_a_verifier_error_is_a_zero_reward_counted_not_a_crash(tmp_path):
    class Broken(ParityTask):
        def score(self, completion, item):
            raise KeyError("verifier fell over")

    run = make_run(micro_config(tmp_path, ["max_staleness=1"]), Broken())
    metrics = list(train.rl_loop_async(run))
    assert metrics and all(m["reward"] == 0 and m["reward/errors"] > 0 for m in metrics)


def test_main_with_max_staleness_runs_and_logs_staleness(tmp_path):
    out, threads = tmp_path / "run", torch.get_num_threads()
    path = tmp_path / "cfg.py"
    path.write_text(MICRO + f"out_dir = {str(out)!r}\n")
    train.main(train.parse_args([str(path), "sft_lr=1e-3", "max_staleness=1", "ckpt_every=0"]))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in records if r["stage"] == "rl"]
    assert [r["step"] for r in rl] == [0, 1, 2]
    assert all(0 <= r["async/staleness_max"] <= 1 for r in rl)
    assert [r["step"] for r in records if r["stage"] == "eval"] == [0, 2, 3]
    assert torch.get_num_threads() == threads  # the trainer thread's count is restored after RL


def test_async_checkpoints_hold_no_rollout_run_ahead_and_resume_finishes(tmp_path):
    """A checkpoint of the async loop holds the data position and prompt history of the steps it
    has trained, as the synchronous loop's does (the producer waits at checkpoint steps), and
    resume=auto continues from it to the end."""
    def run(name, *over):
        out = tmp_path / name
        path = tmp_path / f"{name}.py"
        path.write_text(MICRO + f"out_dir = {str(out)!r}\n")
        # stage 1 on (it never skips at skip_prob 1e-9), so the prompt history is recorded and checkpointed
        train.main(train.parse_args([str(path), "sft_lr=1e-3", "ckpt_every=1", "ckpt_keep=20", "filter.skip_prob=1e-9",
                                     *over]))
        return out

    def states(out):
        return {d.name: torch.load(d / "trainer_state.pt", weights_only=False) for d in sorted((out / "ckpt").iterdir())}

    sync, fast = states(run("sync")), states(run("async", "max_staleness=1"))
    assert sync.keys() == fast.keys() and len(sync) == 4 + 3  # SFT steps, then RL steps
    assert sync[max(sync)]["history"]["records"]  # the history the comparison below is about
    for name, s in sync.items():
        a = fast[name]
        assert a["used"] == s["used"] and a["history"]["records"].keys() == s["history"]["records"].keys(), name
        if a["stage"] == "rl":
            assert all(r[1] <= a["step"] for r in a["history"]["records"].values())
    records = [json.loads(line) for line in (tmp_path / "async" / "metrics.jsonl").read_text().splitlines()]
    assert max(r.get("async/staleness_max", 0) for r in records if r["stage"] == "rl") <= 1

    out = run("resumed", "max_staleness=1", "rl_steps=2")
    run("resumed", "max_staleness=1", "resume=auto")
    rl = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rl if r["stage"] == "rl"] == [0, 1, 2]


def test_negative_max_staleness_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="max_staleness"):
        train.main(load_config(None, ["max_staleness=-1", f"out_dir={tmp_path}"]))
