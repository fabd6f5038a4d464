"""Multi-turn rollouts that call tools (tool_rollout.ToolEngine, issue 34 part 3 in rounds): one stream per row,
tool turns fed with loss mask 0, routes as first recorded, budgets and limits, and the trainer's replayed
forward over a whole multi-turn row equal to the engine's (R3 across turns)."""
import json
import time

import pytest
import torch

import tool_rollout
from logprobs import token_logprobs
from config import EngineConfig
from model import ModelConfig, Transformer
from rollout import NativeEngine
from sampler import Rollout, SamplingParams, Vocab
from tokenizer import IM_END, build_tokenizer, demo_tokenizer
from tool_calls import CallCounts, ToolConfig, ToolResult
from tool_rollout import ToolEngine, turn_seed

TOK = demo_tokenizer(build_tokenizer(512), tools=True)
L, K = 2, 2  # the scripted engine's routes: layers, experts per token
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "123 * 45"}}\n</tool_call>'


class ScriptedEngine:
    """Answers a prompt with a calculator call, and a stream that holds a tool response with the answer: turn
    i's text is script[i] (i = the tool responses so far), ended by <|im_end|>. Routes: position p of call c is
    p + 1000 c (every fed position), so the splice of each round's routes can be read off."""

    def __init__(self, script: list[str], versions: list[int] | None = None):
        self.script, self.versions, self.calls, self.seen = script, versions, 0, []
        self.weight_version = 0

    def generate(self, prompts, params, *, n=1, seed=None, group_ids=None):
        out = []
        for p, g in zip(prompts, group_ids):
            self.seen.append((len(p), params.max_new_tokens, seed, g))
            turn = TOK.decode(p).count("<tool_response>")
            for _ in range(n):
                ids = TOK.encode(self.text(turn, g)) + [TOK.enc.encode_single_token(IM_END)]
                c = min(len(ids), params.max_new_tokens)
                fed = len(p) + c - 1
                routes = (torch.arange(fed)[:, None, None] + 1000 * self.calls).expand(fed, L, K).clone()
                version = self.versions[self.calls] if self.versions else self.weight_version
                out.append(Rollout(list(p), ids[:c], torch.full((c,), -0.5), routes,
                                   "stop" if c == len(ids) else "length", g, version))
        self.calls += 1
        return out

    def text(self, turn: int, group: int) -> str:
        return self.script[turn]

    def phase(self):
        import contextlib
        return contextlib.nullcontext()

    def counters(self):
        return {}


def tool_engine(inner, **limits):
    return ToolEngine(inner, TOK, ToolConfig(enabled=("calculator",), **limits), model_type="qwen3_moe",
                      max_seq_len=4096)


def test_a_tool_turn_is_appended_to_the_stream_fed_with_mask_0_and_routes_kept_as_first_recorded():
    inner = ScriptedEngine([CALL, "<answer>5535</answer>"])
    engine = tool_engine(inner)
    prompt = TOK.prompt_ids("what is 123 * 45?", tools=[engine.tools["calculator"].schema])
    with engine.phase():
        [r] = engine.generate([prompt], SamplingParams(max_new_tokens=200), n=1, seed=7)
        counters = engine.counters()
    turn1 = TOK.encode(CALL) + [TOK.tool_stop_id]
    tool = TOK.tool_turn_ids(["5535"])
    turn2 = TOK.encode("<answer>5535</answer>") + [TOK.tool_stop_id]
    assert r.completion_ids == turn1 + tool + turn2 and r.finish_reason == "stop"
    assert r.loss_mask == [1] * len(turn1) + [0] * len(tool) + [1] * len(turn2)
    assert r.num_trained == len(turn1) + len(turn2)
    assert torch.equal(r.logprobs, torch.tensor([-0.5] * len(turn1) + [0.0] * len(tool) + [-0.5] * len(turn2)))
    T, C = len(prompt), len(r.completion_ids)
    assert r.routes.shape == (T + C - 1, L, K)
    first = T + len(turn1) - 1  # round 0 recorded the prompt and all but its last token
    assert torch.equal(r.routes[:first, 0, 0], torch.arange(first))  # as first recorded
    assert torch.equal(r.routes[first:, 0, 0], torch.arange(first, T + C - 1) + 1000)  # the new positions only
    assert (r.turns, r.tool_calls, r.tool_failures) == (2, 1, 0)
    assert "<answer>5535</answer>" in r.text and "5535" in TOK.decode(tool)
    assert counters["tool_calls"] == 1 and counters["tool_turns"] == 1 and counters["tool_failures"] == 0
    # round 1: the whole stream, the budget left, the turn's own seed, the row's own key (group 0, sample 0)
    assert inner.seen[1] == (T + len(turn1) + len(tool), 200 - len(turn1) - len(tool), turn_seed(7, 1), 0)


def test_limits_end_a_row_max_turns_and_a_budget_a_tool_turn_does_not_fit():
    one = tool_engine(ScriptedEngine([CALL, "<answer>1</answer>"]), max_turns=1)
    [r] = one.generate([[1, 2, 3]], SamplingParams(max_new_tokens=200), seed=0)
    assert r.loss_mask is None and r.turns == 1 and r.tool_calls == 0  # its call is never answered
    turn1 = len(TOK.encode(CALL)) + 1
    tight = tool_engine(ScriptedEngine([CALL, "<answer>1</answer>"]))
    [r] = tight.generate([[1, 2, 3]], SamplingParams(max_new_tokens=turn1 + 3), seed=0)
    assert r.finish_reason == "length" and len(r.completion_ids) == turn1 and r.tool_calls == 1
    cut = tool_engine(ScriptedEngine([CALL, "<answer>" + "9" * 50 + "</answer>"]))
    budget = turn1 + len(TOK.tool_turn_ids(["5535"])) + 4
    [r] = cut.generate([[1, 2, 3]], SamplingParams(max_new_tokens=budget), seed=0)
    assert len(r.completion_ids) == budget and r.finish_reason == "length"  # the whole stream within the budget
    assert r.routes.shape[0] == 3 + budget - 1


def test_a_bad_call_is_an_error_text_and_a_counted_failure_and_samples_get_their_own_streams():
    bad = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 ** 999"}}\n</tool_call>'
    inner = ScriptedEngine([bad, "<answer>0</answer>"])
    engine = tool_engine(inner)
    with engine.phase():
        rows = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=300), n=2, seed=3, group_ids=[5, 9])
        counters = engine.counters()
    assert [(r.group_id, r.turns, r.tool_calls, r.tool_failures) for r in rows] == [(5, 2, 1, 1)] * 2 + [(9, 2, 1, 1)] * 2
    assert counters["tool_failures"] == 4 and counters["tool_calls"] == 4
    assert sorted(g for *_, g in inner.seen[2:]) == [10, 11, 18, 19]  # round 1: a key per row, g * n + j


def test_a_row_whose_rounds_run_on_two_weight_versions_raises():
    engine = tool_engine(ScriptedEngine([CALL, "<answer>1</answer>"], versions=[0, 1]))
    with pytest.raises(RuntimeError, match="spans weight versions 0 and 1"):
        engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=200), seed=0)


def test_a_slow_tool_costs_time_not_tokens(monkeypatch):
    """The rounds wait for a tool that sleeps; what the rows sample does not depend on how long it took."""
    def rows():
        inner = ScriptedEngine([CALL, "<answer>5535</answer>"])
        return [r.completion_ids for r in tool_engine(inner).generate([[1, 2, 3]] * 2, SamplingParams(
            max_new_tokens=200), n=2, seed=1)]
    fast = rows()
    slow_call = tool_rollout.run_calls

    def slow(*args, **kw):
        time.sleep(0.2)
        return slow_call(*args, **kw)
    monkeypatch.setattr(tool_rollout, "run_calls", slow)
    assert rows() == fast


@pytest.mark.parametrize("slots", [0, 2], ids=["static", "continuous"])
def test_the_trainers_replayed_forward_over_a_multi_turn_row_equals_the_engines_logprobs(monkeypatch, slots):
    """R3 across turns on the native engine (fp32): every turn one token (every id stops a row), the first
    turn's token taken as the tool stop and answered; the trainer's forward over the whole stream with the
    recorded routes gives the engine's logprobs at the sampled tokens, and uses exactly those routes."""
    cfg = ModelConfig(vocab_size=TOK.enc.n_vocab, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                      num_experts=4, top_k=2, moe_inter_dim=16, max_seq_len=512)
    torch.manual_seed(0)
    model = Transformer(cfg)
    inner = NativeEngine(cfg, Vocab(list(range(TOK.enc.n_vocab)), TOK.pad_id, decode=TOK.decode),
                         options=EngineConfig(slots=slots))
    inner.update_weights(model.named_parameters(), version=0)
    engine = tool_engine(inner, max_turns=3)
    prompt = TOK.prompt_ids("2 + 3?")
    params = SamplingParams(max_new_tokens=100)
    [probe, _] = inner.generate([prompt, prompt[:-1]], params, seed=11)
    engine.stop_id = probe.completion_ids[-1]  # the first turn's only token ends a turn that calls tools
    monkeypatch.setattr(tool_rollout, "run_calls", lambda *a, **k: ([ToolResult("5")], CallCounts(calls=1)))
    rows = engine.generate([prompt, prompt[:-1]], params, seed=11)  # two prompt lengths: left padding too
    assert rows[0].turns >= 2 and 0 in rows[0].loss_mask
    for r in rows:
        seq = torch.tensor(r.prompt_ids + r.completion_ids)
        T, C = len(r.prompt_ids), len(r.completion_ids)
        assert r.routes.shape == (T + C - 1, cfg.num_moe_layers, cfg.top_k)
        logits, used = model(seq[None, :-1], routed_experts=r.routes[None], return_routes=True)
        logp = token_logprobs(logits, seq[None, 1:])[0, T - 1:]
        trained = torch.tensor(r.loss_mask or [1] * C, dtype=torch.bool)
        torch.testing.assert_close(logp[trained], r.logprobs[trained], rtol=0, atol=1e-5)
        assert torch.equal(used[0], r.routes.long())


def test_a_run_with_the_calculator_enabled_renders_its_schema_and_counts_its_calls(tmp_path):
    """tools.enabled reaches the prompts (the schema in the demo's chat template), the engine (a ToolEngine
    whose counts are logged per step as engine/tool_*) and the evals (tools off, random answers, call rate)."""
    from config import load_config
    from runs import MICRO
    import train
    path = tmp_path / "micro.py"
    path.write_text(MICRO)
    cfg = load_config(str(path), [f"out_dir={tmp_path / 'run'}", "tools.enabled=calculator", "model.max_seq_len=1024",
                                  "reward.tool_failure_weight=0.5"])
    out = train.main(cfg)
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    rl = [m for m in records if m.get("stage") == "rl"]
    assert rl and all("engine/tool_calls" in m and "engine/tool_ms" in m for m in rl)
    evals = [m for m in records if m.get("stage") == "eval"]
    assert evals and all({"eval_tools_off", "eval_random_tools", "eval_call_rate"} <= set(m) for m in evals)
    assert set(out) == {"optimizer_steps", "sampled", "greedy", "tools off", "random tools", "call rate"}


def test_random_answers_keep_a_tools_schema_and_errors_and_change_its_digits():
    from evaluation import RandomAnswers
    from tool_calls import Calculator
    control = RandomAnswers(Calculator())
    assert control.name == "calculator" and control.schema == Calculator.schema
    answer = control.call({"expression": "123 * 45"})
    assert answer.ok and len(answer.text) == 4 and answer.text != "5535" and answer == control.call({"expression": "123 * 45"})
    assert not control.call({"expression": "2 ** 9"}).ok


def test_an_sft_demonstration_calls_the_calculator_for_its_share_of_questions():
    """tools.sft_call_share of the items (spread by item index) call the calculator with the question's expression,
    the tool turn fed with mask 0, then answer; the rest, and questions without arithmetic, answer directly."""
    from data import Item
    from tool_rollout import arithmetic_expression, demonstration_ids
    cfg = ToolConfig(enabled=("calculator",), sft_call_share=0.5)
    assert arithmetic_expression("Calculate 261 - 120 - 507.") == "261 - 120 - 507"
    assert arithmetic_expression("What is the capital of France?") is None
    demos = [demonstration_ids(TOK, cfg, "qwen3_moe", Item("Calculate 261 - 120 - 507.", "-366", 0, i), "<answer>-366</answer>")
             for i in range(100)]
    calling = [(ids, mask) for ids, mask in demos if mask is not None]
    assert 45 <= len(calling) <= 55
    ids, mask = calling[0]
    tool = TOK.tool_turn_ids(["-366"])
    call = TOK.encode('<tool_call>\n{"name": "calculator", "arguments": {"expression": "261 - 120 - 507"}}\n</tool_call>')
    assert ids == call + [TOK.tool_stop_id] + tool + TOK.encode("<answer>-366</answer>") + [TOK.stop_ids[0]]
    assert mask == [1] * (len(call) + 1) + [0] * len(tool) + [1] * (len(ids) - len(call) - 1 - len(tool))
    plain = demonstration_ids(TOK, ToolConfig(), "qwen3_moe", Item("Calculate 1 + 2.", "3", 0, 0), "<answer>3</answer>")
    assert plain == (TOK.encode("<answer>3</answer>") + [TOK.stop_ids[0]], None)


class CountingEngine(ScriptedEngine):
    """ScriptedEngine whose prompts of group 0 call the calculator in two turns and the others answer at once;
    it counts its generate calls, rows or none."""

    def __init__(self):
        super().__init__([CALL, CALL, "<answer>5535</answer>"])
        self.generate_calls = 0

    def text(self, turn: int, group: int) -> str:
        return self.script[turn] if group == 0 else self.script[-1]

    def generate(self, prompts, params, *, n=1, seed=None, group_ids=None):
        self.generate_calls += 1
        return super().generate(prompts, params, n=n, seed=seed, group_ids=group_ids)


def lockstep_worker(rank, world, port, out):
    import torch.distributed as dist
    import os
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        inner = CountingEngine()
        rows = tool_engine(inner, max_turns=3).generate([[1, 2, 3 + rank]], SamplingParams(max_new_tokens=300),
                                                        seed=5, group_ids=[rank])
        torch.save({"calls": inner.generate_calls, "rows": [(r.completion_ids, r.turns) for r in rows]},
                   f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_every_rank_makes_as_many_generate_calls_as_the_rank_whose_rows_call_tools_longest(tmp_path):
    """Under torchrun (2 gloo ranks) the rounds keep the ranks in lockstep: rank 1's row answers at once, rank 0's
    calls a tool twice, and both ranks call generate 3 times (rank 1 twice with no rows), as the sharded engine's
    collectives need; each row is what one process makes of it."""
    import torch.multiprocessing as mp
    from runs import free_port
    mp.start_processes(lockstep_worker, args=(2, free_port(), str(tmp_path / "out")), nprocs=2, join=True,
                       start_method="spawn")
    got = [torch.load(f"{tmp_path / 'out'}.{rank}") for rank in range(2)]
    assert [g["calls"] for g in got] == [3, 3]
    one = CountingEngine()
    alone = tool_engine(one, max_turns=3).generate([[1, 2, 3], [1, 2, 4]], SamplingParams(max_new_tokens=300),
                                                   seed=5, group_ids=[0, 1])
    assert [g["rows"][0] for g in got] == [(r.completion_ids, r.turns) for r in alone]
    assert [r.turns for r in alone] == [3, 1]


def test_failed_calls_cost_inside_the_correctness_class_and_never_lift_a_wrong_answer():
    """reward.tool_failure_weight: minus the share of a row's calls that failed enters as shaping through
    adjust_rewards, so among the correct rows a clean one beats one with failures, and every correct row stays
    above every wrong one, however the wrong ones called."""
    from reward import RewardConfig
    from shaping import order_violations, shaped_rewards
    correct = torch.tensor([1.0, 1.0, 0.0, 0.0])
    failed = [0.0, 1.0, 0.0, 1.0]
    r = shaped_rewards(correct, [[1]] * 4, RewardConfig(tool_failure_weight=1.0), max_new_tokens=8, failed_share=failed)
    assert r[0] > r[1] > r[2] > r[3] and order_violations(correct, r) == (4, 0)
    assert torch.equal(shaped_rewards(correct, [[1]] * 4, RewardConfig(), max_new_tokens=8, failed_share=failed), correct)


LONG_CALL = CALL.replace("123 * 45", " + ".join(["1"] * 40))


class TwoScripts(ScriptedEngine):
    """Group 0 calls with a long expression, group 1 with a short one; both answer after one tool turn."""

    def text(self, turn: int, group: int) -> str:
        return [LONG_CALL if group == 0 else CALL, "<answer>1</answer>"][turn]


def test_a_row_that_ended_is_never_answered_again_while_others_go_on():
    """A row whose tool turn does not fit its budget ends, its calls counted once, while a row beside it takes
    its turns: the rounds never answer an ended row's last turn again."""
    budget = len(TOK.encode(LONG_CALL)) + 1 + 3  # the long call fits, its tool turn not; the short row's turns do
    assert len(TOK.encode(CALL)) + 1 + len(TOK.tool_turn_ids(["5535"])) + len(TOK.encode("<answer>1</answer>")) + 1 < budget
    engine = tool_engine(TwoScripts([]))
    with engine.phase():
        long_row, short_row = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=budget), seed=0)
        counters = engine.counters()
    assert long_row.finish_reason == "length" and long_row.turns == 1 and long_row.tool_calls == 1
    assert short_row.turns == 2 and short_row.tool_calls == 1
    assert counters["tool_calls"] == 2


SHARDED_MODEL = ["model.vocab_size=512", "model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
                 "model.head_dim=8", "model.num_experts=4", "model.top_k=2", "model.moe_inter_dim=16",
                 "model.max_seq_len=256", "model.init_std=0.3", "ep=2"]
SHARDED_PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
GREEDY = SamplingParams(max_new_tokens=60, temperature=0.0)


def answering_every_call(monkeypatch=None):
    """run_calls as if each turn held one call, answered "5" (the model is random: it writes no call itself)."""
    fake = lambda *a, **k: ([ToolResult("5")], CallCounts(calls=1))  # noqa: E731
    if monkeypatch is not None:
        monkeypatch.setattr(tool_rollout, "run_calls", fake)
    else:
        tool_rollout.run_calls = fake


def sharded_tool_worker(rank, world, port, stop_id, out):
    import os
    import torch.distributed as dist
    import distributed
    from config import load_config
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        answering_every_call()
        cfg = load_config(None, SHARDED_MODEL)
        torch.manual_seed(cfg.seed)
        policy = distributed.build_model(cfg, distributed.build_meshes(world, 2))
        inner = NativeEngine(cfg.model, Vocab(tuple(range(TOK.enc.n_vocab)), TOK.pad_id, decode=TOK.decode),
                             policy=policy)
        engine = tool_engine(inner, max_turns=3)
        engine.stop_id = stop_id
        mine = [0] if rank == 0 else [1, 2]  # rank 0's row takes a tool turn, rank 1's end at once
        with engine.phase():
            rows = engine.generate([SHARDED_PROMPTS[i] for i in mine], GREEDY, seed=3, group_ids=mine)
        got = distributed.all_gather_list([(r.group_id, r.completion_ids, r.logprobs, r.routes.long(), r.turns)
                                           for r in rows])
        if rank == 0:
            torch.save(got, out)
    finally:
        dist.destroy_process_group()


def test_two_sharded_ranks_give_the_one_process_multi_turn_rollouts(tmp_path, monkeypatch):
    """The rounds over the sharded native engine (2 gloo ranks, expert parallel): rank 0's row takes a tool turn
    while rank 1's rows have ended, so rank 1 joins the round's collectives with no rows; every row equals what
    one process's ToolEngine over a replica makes of it (tokens, logprobs within 1e-5, routes), every turn one
    greedy token (every id stops a turn), the first prompt's first token taken as the tool stop."""
    import torch.multiprocessing as mp
    import distributed
    from config import load_config
    from runs import free_port
    from weights import policy_tensors
    cfg = load_config(None, SHARDED_MODEL)
    torch.manual_seed(cfg.seed)
    model = distributed.build_model(cfg)
    replica = NativeEngine(cfg.model, Vocab(tuple(range(TOK.enc.n_vocab)), TOK.pad_id, decode=TOK.decode))
    replica.update_weights(policy_tensors(model), version=0)
    stop_id = replica.generate(SHARDED_PROMPTS[:1], GREEDY, seed=3)[0].completion_ids[-1]
    answering_every_call(monkeypatch)
    engine = tool_engine(replica, max_turns=3)
    engine.stop_id = stop_id
    want = [(r.group_id, r.completion_ids, r.logprobs, r.routes.long(), r.turns)
            for r in engine.generate(SHARDED_PROMPTS, GREEDY, seed=3)]
    assert want[0][4] >= 2  # the first prompt's row takes a tool turn: a round in which rank 1 may have no rows
    mp.start_processes(sharded_tool_worker, args=(2, free_port(), stop_id, str(tmp_path / "out.pt")), nprocs=2,
                       join=True, start_method="spawn")
    got = sorted(torch.load(tmp_path / "out.pt"), key=lambda r: r[0])
    for (g, ids, logp, routes, turns), (wg, wids, wlogp, wroutes, wturns) in zip(got, want, strict=True):
        assert (g, ids, turns) == (wg, wids, wturns)
        torch.testing.assert_close(logp, wlogp, rtol=0, atol=1e-5)
        assert torch.equal(routes, wroutes)


def test_async_steps_with_tools_run_on_a_tool_engine_of_their_own(tmp_path):
    """max_staleness=1 with the calculator: the producer's engine is a ToolEngine over its own copy of the
    native engine (rollout.producer_engine), its tool counts logged per step, rollouts at most one version old."""
    from config import load_config
    from rollout import producer_engine
    from runs import MICRO
    import train
    path = tmp_path / "micro.py"
    path.write_text(MICRO)
    cfg = load_config(str(path), [f"out_dir={tmp_path / 'run'}", "tools.enabled=calculator", "model.max_seq_len=1024",
                                  "max_staleness=1", "ckpt_every=0"])
    train.main(cfg)
    rl = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl") if '"stage": "rl"' in line]
    assert rl and all("engine/tool_calls" in m and 0 <= m["async/staleness_max"] <= 1 for m in rl)
    inner = ScriptedEngine([CALL, "<answer>1</answer>"])
    with pytest.raises(ValueError, match="native engine only"):  # a ToolEngine's producer is its inner engine's
        producer_engine(tool_engine(inner), cfg, None)
