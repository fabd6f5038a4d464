import pytest
import torch

from filter import post_rollout_filter
from data import TaskMix, demonstration
from scheduler import LengthPredictor, Pipeline, generation_batches, length_buckets
from trainer import pack_microbatches


def test_post_rollout_filter_drops_zero_variance_groups_and_counts_them():
    rewards = torch.tensor([[1.0, 1, 1, 1], [0, 1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]])
    lengths = torch.tensor([[3, 4, 5, 6], [1, 1, 1, 1], [2, 2, 2, 2], [10, 0, 0, 0]])
    keep, stats = post_rollout_filter(rewards, lengths)
    assert keep.tolist() == [False, True, False, False]
    assert stats["groups_dropped"] == 3 and stats["all_correct"] == 1 and stats["all_wrong"] == 2
    assert stats["rollouts_dropped"] == 12 and stats["tokens_dropped"] == 18 + 8 + 10
    assert stats["zero_variance_frac"] == 0.75


def test_post_rollout_filter_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="same"):
        post_rollout_filter(torch.zeros(2, 4), torch.zeros(2, 3))


@pytest.fixture(scope="module")
def mix():
    return TaskMix([("chain_sum", dict(min_terms=2, max_terms=2, min_digits=2, max_digits=2)),
                    ("products", dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1))], seed=3, size=10)


def test_reward_is_one_only_for_the_exact_answer_inside_answer_tags(mix):
    item = mix[0]
    assert mix.score(demonstration(item), item) == 1.0
    assert mix.score(f"thinking... <answer>0</answer> no wait <answer>{item.answer}</answer>", item) == 1.0
    assert mix.score(item.answer, item) == 0.0  # no tags: no reward
    assert mix.score(f"<answer>{item.answer}</answer>"[:-1], item) == 0.0  # unclosed tag


def test_partial_credit_is_not_a_reward(mix):
    item = next(it for it in mix.items if len(it.answer) >= 2)
    ds = mix.datasets[item.task]
    partial = item.answer + "0"  # contains the gold answer as a substring
    assert 0 < ds.score_answer(partial, ds[item.index]) < 1.0
    assert mix.score(f"<answer>{partial}</answer>", item) == 0.0


def test_task_mix_interleaves_tasks_and_excludes_training_questions(mix):
    assert [it.task for it in mix.items[:4]] == [0, 1, 0, 1]
    seen = {mix[0].question, mix[3].question}
    left = mix.exclude(seen)
    assert all(it.question not in seen for it in left) and len(left) <= len(mix) - 2


def test_unknown_dataset_is_a_value_error():
    with pytest.raises(ValueError, match=r"tasks\[0\]=\('no_such_task', \{\}\): reasoning-gym refuses it \("):
        TaskMix([("no_such_task", {})], seed=0, size=2)


def test_length_buckets_put_similar_lengths_together():
    pred = [5, 100, 7, 90, 6, 95]
    assert length_buckets(pred, 2) == [[1, 5], [3, 2], [4, 0]]


def test_pack_microbatches_respects_padded_token_budget():
    lengths = [10, 3, 8, 2, 7, 25]
    batches = pack_microbatches(lengths, token_budget=20)
    assert sorted(i for b in batches for i in b) == list(range(6))
    for b in batches:
        assert len(b) * max(lengths[i] for i in b) <= 20 or len(b) == 1
    assert [5] in batches  # longer than the budget: alone


def test_length_predictor_uses_history_then_task_bucket_then_global_mean_then_prior():
    p = LengthPredictor(prior=12.0)
    assert p.predict("a") == 12.0
    p.observe("a", 4, task="sum", prompt_len=10)
    p.observe("a", 6, task="sum", prompt_len=20)
    p.observe("z", 20, task="code", prompt_len=10)
    assert p.predict("a") == 5.0  # its own history
    assert p.predict("b", task="sum", prompt_len=30) == 5.0  # same task, same prompt-length bucket
    assert p.predict("c", task="math", prompt_len=10) == 10.0  # unseen task: mean of everything
    q = LengthPredictor(prior=1.0)
    q.load_state_dict(p.state_dict())
    assert q.predict("b", task="sum", prompt_len=30) == 5.0 and q.predict("a") == 5.0


def run_pipeline(max_staleness, steps=5, sync_before=None):
    import threading
    engine_version, events, lock = [0], [], threading.Lock()

    def produce(step):
        with lock:
            events.append(("produce", step, engine_version[0]))
        return step

    def apply(weights, version):
        engine_version[0] = version

    pipe = Pipeline(produce, apply, steps=steps, max_staleness=max_staleness, timeout=10, sync_before=sync_before)
    for step in range(steps):
        assert pipe.next() == step
        with lock:
            events.append(("train", step, None))
        pipe.publish(weights=None, version=step + 1)
    pipe.close()
    return events


def test_pipeline_with_staleness_zero_is_synchronous_on_policy():
    events = run_pipeline(0)
    produced = [(s, v) for kind, s, v in events if kind == "produce"]
    assert produced == [(s, s) for s in range(5)]  # batch s always from weights version s
    assert [k for k, *_ in events] == ["produce", "train"] * 5


def test_pipeline_with_staleness_one_never_uses_weights_older_than_one_step():
    events = run_pipeline(1)
    produced = [(s, v) for kind, s, v in events if kind == "produce"]
    assert all(s - 1 <= v <= s for s, v in produced)


def test_pipeline_waits_for_the_newest_weights_before_a_sync_step():
    events = run_pipeline(2, steps=6, sync_before=lambda step: step == 3)
    produced = {s: v for kind, s, v in events if kind == "produce"}
    assert produced[3] == 3  # nothing of step 3 ran before the weights of step 2 were published
    assert events.index(("produce", 3, 3)) > events.index(("train", 2, None))
    assert all(s - 2 <= v <= s for s, v in produced.items())


def test_pipeline_reraises_a_producer_error_in_the_trainer():
    def produce(step):
        raise RuntimeError("engine fell over")

    pipe = Pipeline(produce, lambda w, v: None, steps=3, max_staleness=1, timeout=10)
    with pytest.raises(RuntimeError, match="engine fell over"):
        pipe.next()
    pipe.close()


def test_pipeline_with_staleness_two_stays_within_two_versions_and_runs_ahead():
    events = run_pipeline(2, steps=6)
    produced = [(s, v) for kind, s, v in events if kind == "produce"]
    assert [s for s, _ in produced] == list(range(6))
    assert all(s - 2 <= v <= s for s, v in produced)


def test_pipeline_next_times_out_instead_of_hanging_and_close_stops_a_waiting_producer():
    pipe = Pipeline(lambda step: step, lambda w, v: None, steps=10, max_staleness=0, timeout=0.2)
    assert pipe.next() == 0
    with pytest.raises(TimeoutError):
        pipe.next()  # step 1 waits for version 1, never published
    pipe.close()
    pipe.thread.join(10)  # a generous bound: a loaded machine may be slow to wake it; no timing is asserted
    assert not pipe.thread.is_alive()  # the waiting producer was told to stop, and did


def test_pipeline_rejects_negative_staleness():
    with pytest.raises(ValueError, match="max_staleness"):
        Pipeline(lambda s: s, lambda w, v: None, steps=1, max_staleness=-1)


def test_generation_batches_spread_each_length_bucket_over_every_worker():
    predictor = LengthPredictor(prior=10.0)
    for key, completion in (("a", 10), ("b", 90), ("c", 10), ("d", 20), ("e", 5)):
        predictor.observe(key, completion)
    # (key, task, prompt_len): predicted 15, 100, 15, 30, 10 tokens
    requests = [("a", 0, 5), ("b", 0, 10), ("c", 0, 5), ("d", 0, 10), ("e", 0, 5)]
    one = generation_batches(predictor, requests, 2)
    assert one == [[1, 3], [0, 2], [4]]  # longest first, similar lengths together
    two = [generation_batches(predictor, requests, 1, num_ranks=2, rank=w) for w in (0, 1)]
    # the same batches, each dealt over both workers: as many calls on each (lockstep), none above 1 prompt
    assert two == [[[1], [0], [4]], [[3], [2], []]]
