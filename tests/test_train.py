import dataclasses
import json
import os

import pytest
import torch
from safetensors.torch import load_file

import train
from config import TrainConfig, load_config
from data import prompt_ids
from hf import load_hf
from metrics import MetricsLog
from runs import MICRO, make_run, micro_config
from tokenizer import load_hf_tokenizer
from trainer import TrainBatch, sequence_batch, train_on_rollouts


def write_config(tmp_path, text):
    path = tmp_path / "cfg.py"
    path.write_text(text)
    return str(path)


def test_config_file_holds_deltas_and_overrides_are_typed(tmp_path):
    path = write_config(tmp_path, "rl_steps = 7\nmodel = dict(dim=64, n_layers=2)\n")
    cfg = load_config(path, ["lr=3e-4", "model.top_k=3", "router_replay=false", "loss.type=grpo"])
    assert cfg.rl_steps == 7 and cfg.lr == 3e-4 and cfg.router_replay is False and cfg.loss.type == "grpo"
    assert cfg.model.dim == 64 and cfg.model.n_layers == 2 and cfg.model.top_k == 3
    assert cfg.group_size == TrainConfig().group_size  # untouched fields keep their defaults


@pytest.mark.parametrize("override, match", [
    ("rl_step=3", "did you mean rl_steps"),
    ("model.dimm=3", "did you mean model.dim"),
    ("lr=fast", "need a number"),
    ("router_replay=maybe", "need True or False"),
    ("tasks=x", "config file"),
    ("lr", "key=value"),
])
def test_bad_overrides_are_value_errors_that_say_what_is_valid(override, match):
    with pytest.raises(ValueError, match=match):
        load_config(None, [override])


@pytest.mark.parametrize("override, match", [
    ("filter.probe_size=1", "probe_size"),
    ("filter.enlarged_group_size=12", "needs probe_size"),
    ("filter.zero_variance=keep", "zero_variance"),
    ("reward.shaping_margin=0.5", "shaping_margin"),
    ("ckpt_keep=0", "ckpt_keep=0:"),
    ("logger=mlflow", "logger='mlflow'"),
    ("resume=/nonexistent", "not a complete checkpoint"),
])
def test_bad_filter_or_reward_settings_fail_before_any_training(override, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        train.main(load_config(None, [override, f"out_dir={tmp_path}"]))


def test_unknown_key_in_config_file_names_close_matches(tmp_path):
    path = write_config(tmp_path, "group_sise = 4\n")
    with pytest.raises(ValueError, match="did you mean group_size"):
        load_config(path, [])


def test_sequence_batch_masks_exactly_the_completion_targets():
    inputs, targets, mask, routes = sequence_batch([[1, 2, 3, 4, 5], [6, 7, 8]], [3, 1], pad_id=0,
                                                         routes=[torch.ones(4, 2, 1), torch.ones(2, 2, 1)],
                                                         num_layers=2, top_k=1)
    assert inputs.tolist() == [[1, 2, 3, 4], [6, 7, 0, 0]]
    assert targets.tolist() == [[-1, -1, 4, 5], [7, 8, -1, -1]]  # NO_TARGET: no logprob is computed there
    assert mask.tolist() == [[0, 0, 1, 1], [1, 1, 0, 0]]  # targets 4, 5 and 7, 8 are completion tokens
    assert (routes[1, 2:] == -1).all() and (routes[0] == 1).all()




def test_tiny_run_end_to_end_writes_metrics_checkpoint_and_plot(tmp_path):
    out = tmp_path / "run"
    path = write_config(tmp_path, MICRO + f"out_dir = {str(out)!r}\n")
    result = train.main(train.parse_args([path, "sft_lr=1e-3"]))
    assert set(result) == {"optimizer_steps", "sampled", "greedy"}
    assert set(result["greedy"]) == {"sft_acc", "sft_se", "rl_acc", "rl_se", "gain", "gain_paired_se"}
    # the final model in the HF hub layout, beside the run's own files
    for name in ("metrics.jsonl", "model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "run_config.json", "plot.png"):
        assert (out / name).stat().st_size > 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["stage"] == "eval"] == [0, 2, 3]
    rl = [r for r in records if r["stage"] == "rl"]
    assert len(rl) == 3 and all(0 <= r["filter/zero_variance_frac"] <= 1 for r in rl)
    # each RL step logs the optimizer steps it took (num_minibatches, or 0 when every group was dropped); the run
    # reports their sum
    n = json.loads((out / "run_config.json").read_text())["num_minibatches"]
    assert all(r["optimizer_steps"] == (0 if r.get("skipped_update") else n) for r in rl)
    assert result["optimizer_steps"] == sum(r["optimizer_steps"] for r in rl)
    # the engine's logprobs equal the trainer's old logprobs under replay, through train.py's own batching
    assert all(r["mismatch/max_abs_logp"] <= 1e-5 for r in rl if "mismatch/max_abs_logp" in r)
    # it loads as this project's init_from (the run's own shape, weights and tokenizer)
    saved = json.loads((out / "run_config.json").read_text())["model"]
    model = load_hf(str(out))
    # intermediate_size stands in for the width of dense blocks this model has none of
    assert dataclasses.asdict(model.cfg) == {**saved, "dense_inter_dim": model.cfg.dense_inter_dim}
    tok = load_hf_tokenizer(str(out))
    ids = tok.prompt_ids("1 + 2 =")
    assert ids[0] == tok.bos_id and tok.decode(ids[1:]) == "1 + 2 =\n"  # the demo's plain layout


def test_rl_step_replays_engine_routes_updates_the_policy_and_syncs_the_engine(tmp_path):
    run = make_run(micro_config(tmp_path, ["sampling.temperature=1.5"]))
    before = {n: p.detach().clone() for n, p in run.model.named_parameters()}
    m = train.rl_step(run, step=0)
    assert "skipped_update" not in m and m["trained_sequences"] > 0
    assert m["mismatch/max_abs_logp"] <= 1e-5
    assert run.engine.weight_version == 1
    assert any(not torch.equal(before[n], p) for n, p in run.model.named_parameters())
    for (n, p), (_, q) in zip(run.model.named_parameters(), run.engine.model.named_parameters()):
        assert torch.equal(p, q), n


@pytest.mark.parametrize("num_minibatches", [1, 2])
def test_the_first_minibatch_takes_pi_old_from_its_own_forward(tmp_path, num_minibatches):
    """Before the first optimizer step pi_old is the current policy: the trainer runs no separate
    no-grad forward for the first mini-batch (none at all with one mini-batch), and its PPO ratio is 1."""
    run = make_run(micro_config(tmp_path, ["sampling.temperature=1.5", f"num_minibatches={num_minibatches}"]))
    m, batch = train.collect_rollouts(run, 0)
    forwards = []
    run.model.register_forward_hook(lambda mod, args, out: forwards.append(torch.is_grad_enabled()))
    m = train_on_rollouts(run.model, run.opt, batch, 0, run.cfg)
    no_grad = forwards.count(False)
    assert (no_grad == 0) if num_minibatches == 1 else (0 < no_grad < forwards.count(True))
    assert m["mismatch/max_abs_logp"] <= 1e-5
    if num_minibatches == 1:
        assert m["loss/ratio_min"] == m["loss/ratio_max"] == 1.0


def test_rl_step_with_every_stage_on_trains_and_counts_what_each_stage_saved(tmp_path):
    run = make_run(micro_config(tmp_path, [
        "sampling.temperature=1.5", "filter.skip_prob=1.0", "filter.probe_size=2", "filter.enlarged_group_size=6",
        "filter.oversample_rounds=2", "filter.zero_variance=rl-zvp", "reward.workers=2", "reward.overlong_buffer=4",
        "reward.repetition_weight=0.5", "reward.model=stub"]))
    with run.pool:
        m0 = train.rl_step(run, 0)
        nxt = run.prompts.task[run.prompts.order[run.prompts.used]]
        run.history.observe(nxt.question, 1.0, step=0)  # the next prompt drawn, all correct: stage 1 must skip it
        m1 = train.rl_step(run, 1)
    assert m1["filter/stage1_prompts_skipped"] >= 1 and m1["filter/stage1_rollouts_saved"] >= run.cfg.group_size
    for m in (m0, m1):
        assert "skipped_update" not in m and m["reward/timeouts"] == m["reward/errors"] == 0
        groups = m["filter/groups"]
        stopped = m["filter/stage2_prompts_stopped"]
        # stopped prompts keep their 2 probes, the others get the enlarged 6
        assert m["filter/rollouts_generated"] == 2 * stopped + 6 * (groups - stopped)
        assert m["trained_sequences"] == m["filter/rollouts_generated"]  # RL-ZVP trains on every group
        assert m["filter/rollouts_dropped"] == 0 and m["filter/zvp_sequences"] >= 2 * m["filter/zvp_groups"]
    assert run.engine.weight_version == 2


def test_token_advantages_replace_a_sequences_advantage_only_where_given():
    batch = TrainBatch(seqs=[[1, 2, 3], [4, 5, 6, 7]], starts=[1, 2], routes=[None, None],
                             adv_B=torch.tensor([0.5, -1.0]))
    assert batch.advantages([0, 1], 3).tolist() == [0.5, -1.0]
    batch.adv_tokens[1] = torch.tensor([0.0, 0.2, 0.3])
    assert torch.equal(batch.advantages([0, 1], 3), torch.tensor([[0.5, 0.5, 0.5], [0.0, 0.2, 0.3]]))


@pytest.mark.parametrize("loss_type", ["espo", "grpo"])
def test_policy_loss_with_constant_token_advantages_equals_sequence_advantages(loss_type):
    from espo import LossConfig, policy_loss
    B, T, V = 3, 5, 11
    logp = torch.randn(B, T, requires_grad=True)
    old, ent, adv = logp.detach() + 0.1 * torch.randn(B, T), torch.rand(B, T), torch.randn(B)
    mask = torch.ones(B, T)
    mask[0, 3:] = 0
    cfg = LossConfig(type=loss_type)
    seq, _ = policy_loss(logp, old, adv, mask, cfg, vocab_size=V, old_entropy_BT=ent)
    tok, _ = policy_loss(logp, old, adv[:, None].expand(B, T), mask, cfg, vocab_size=V, old_entropy_BT=ent)
    assert torch.allclose(seq, tok, atol=0, rtol=1e-6)


def test_engine_logprobs_line_up_with_the_loss_mask():
    batch = TrainBatch(seqs=[[1, 2, 3, 4, 5], [6, 7, 8]], starts=[3, 1], routes=[None, None], adv_B=torch.zeros(2),
                             infer_logp=[torch.tensor([-0.1, -0.2]), torch.tensor([-0.3, -0.4])])
    _, _, mask, _ = sequence_batch(batch.seqs, batch.starts, pad_id=0)
    assert torch.equal(batch.engine_logp([0, 1], T=4), torch.tensor([[0, 0, -0.1, -0.2], [-0.3, -0.4, 0, 0]]))
    assert mask.tolist() == [[0, 0, 1, 1], [1, 1, 0, 0]]


def test_rl_step_passes_loss_options_through_with_a_frozen_reference(tmp_path):
    import copy

    run = make_run(micro_config(tmp_path, ["sampling.temperature=1.5", "loss.type=gspo", "loss.kl_coef=0.1",
                                           "loss.kl_estimator=k1", "loss.tis_cap=2.0",
                                           "loss.aggregation=token-mean"]))
    run.ref_model = copy.deepcopy(run.model).requires_grad_(False)
    m = train.rl_step(run, step=0)
    assert "skipped_update" not in m and "loss/kl_ref" in m
    # under router replay the engine's logprobs equal pi_old, so aligned TIS weights are all 1
    assert m["loss/mismatch/tis_truncated_frac"] == 0 and abs(m["loss/mismatch/is_weight_mean"] - 1) <= 1e-4


def test_every_config_field_has_a_docstring():
    import ast
    import inspect

    from config import SECTIONS
    # the run-wide fields and every section's (model, sampling, loss, filter, reward, engine); RULES, a class
    # attribute without annotation, is no field
    assert {"model", "sampling", "loss", "filter", "reward", "engine"} <= set(SECTIONS)
    for cls in (TrainConfig, *SECTIONS.values()):
        body = ast.parse(inspect.getsource(cls)).body[0].body
        for node, nxt in zip(body, body[1:] + [None]):
            if isinstance(node, ast.AnnAssign):
                assert isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant), \
                    f"{cls.__name__}.{node.target.id} has no docstring"


def test_logger_choice_is_checked_and_a_missing_package_is_a_clear_error(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="logger='mlflow': need one of 'none', 'tensorboard', 'wandb'"):
        load_config(None, [f"out_dir={tmp_path}", "logger=mlflow"])
    monkeypatch.setitem(__import__("sys").modules, "wandb", None)  # as if not installed
    with pytest.raises(ValueError, match="pip install wandb"):
        MetricsLog(str(tmp_path), logger="wandb")


def test_tensorboard_logger_writes_events_beside_the_jsonl(tmp_path):
    pytest.importorskip("tensorboard")
    log = MetricsLog(str(tmp_path), logger="tensorboard")
    log({"stage": "rl", "step": 0, "reward": 0.5, "loss": 1.0})
    log.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"stage": "rl", "step": 0, "reward": 0.5, "loss": 1.0}
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tensorboard").iterdir())


def test_logged_mismatch_is_espo_mismatch_metrics_of_the_engine_against_pi_old(tmp_path):
    """The trainer's mismatch/* metrics are espo.mismatch_metrics over the sampled tokens, with pi_old the
    trainer's own logprobs (routes replayed); an engine on other weights shows the gap."""
    from espo import mismatch_metrics
    from logprobs import token_logprobs
    run = make_run(micro_config(tmp_path, ["sampling.temperature=1.5", "num_minibatches=1"]))
    with torch.no_grad():
        for p in run.engine.model.parameters():
            p.add_(0.01 * torch.randn_like(p))  # the engine's weights drift from the trainer's
    m, batch = train.collect_rollouts(run, 0)
    old = []
    with torch.no_grad():
        for i in range(len(batch.seqs)):
            inputs, targets, _, routes = batch.micro([i], run.cfg)
            logp = token_logprobs(run.model(inputs, routed_experts=routes)[0], targets, run.cfg.sampling.temperature)
            old.append(logp[0, batch.starts[i] - 1:])
    want = mismatch_metrics(batch.infer_logp, old)
    got = train_on_rollouts(run.model, run.opt, batch, 0, run.cfg)
    assert want["mismatch/kl"] > 1e-6
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-4, abs=1e-9), k


def test_activation_checkpointing_in_one_process_recomputes_without_changing_the_losses(tmp_path):
    def losses(name, *over):
        out = tmp_path / name
        path = write_config(tmp_path, MICRO + f"out_dir = {str(out)!r}\n")
        train.main(train.parse_args([path, "sft_lr=1e-3", "ckpt_every=0", *over]))
        return [(r.get("loss"), r.get("reward")) for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]

    assert losses("plain") == losses("recompute", "activation_checkpoint=true")


def test_bf16_on_one_process_computes_in_bf16_with_fp32_weights_grads_optimizer_router_and_loss(tmp_path):
    """dtype=bfloat16: FSDP2's mixed precision on a one-rank mesh, the arithmetic of many ranks."""
    import torch.distributed as dist

    import distributed
    cfg = micro_config(tmp_path, ["dtype=bfloat16"])
    meshes = distributed.setup_distributed(cfg)
    try:
        assert meshes is not None and cfg.compute_dtype() == torch.bfloat16
        model = distributed.build_model(cfg, meshes)
        seen = {}

        def record(name):
            def hook(module, args, out):
                seen[name] = out.dtype  # returns None: the output stays as it is
            return hook

        model.layers[0].attn.register_forward_hook(record("attn"))
        model.layers[0].mlp.gate.register_forward_hook(record("router"))
        tokens = torch.randint(0, cfg.model.vocab_size, (2, 9))
        (logp, entropy), _ = model(tokens[:, :-1], tokens[:, 1:])
        loss = -logp.mean()
        loss.backward()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        opt.step()
        assert seen == {"attn": torch.bfloat16, "router": torch.float32}
        assert loss.dtype == logp.dtype == entropy.dtype == torch.float32
        for p in model.parameters():
            assert p.dtype == p.grad.dtype == torch.float32
            assert all(v.dtype == torch.float32 for v in opt.state[p].values() if v.dim())
    finally:
        dist.destroy_process_group()


def test_a_bf16_run_trains_end_to_end_with_a_bf16_engine(tmp_path):
    out = tmp_path / "run"
    path = write_config(tmp_path, MICRO + f"out_dir = {str(out)!r}\n")
    # RL-ZVP: the micro model's all-wrong groups train too, so every step has a loss
    train.main(train.parse_args([path, "sft_lr=1e-3", "dtype=bfloat16", "ckpt_every=2", "ckpt_keep=1",
                                 "filter.zero_variance=rl-zvp"]))
    rl = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rl if r["stage"] == "rl" and "loss" in r]
    assert rl and all(torch.isfinite(torch.tensor(r["loss"])) for r in rl)
    # bf16 engine against a bf16 trainer: close, not equal (the fp32 run matches to 1e-5)
    assert all(0 < r["mismatch/max_abs_logp"] < 0.5 for r in rl)
    weights = load_file(out / "model.safetensors")
    assert all(t.dtype == torch.float32 for t in weights.values())  # the master weights, gathered


def test_prompts_longer_than_max_prompt_tokens_leave_the_order_counted(tmp_path):
    from data import Item
    from runs import ParityTask
    cfg = micro_config(tmp_path, [])
    tok = make_run(cfg).tok
    task = ParityTask(size=4)
    task.items[2] = Item("question " + "long " * 40, "0", 0, 2)
    limit = len(prompt_ids(tok, task, task.items[0]))
    prompts = train.Prompts(task, [3, 2, 1, 0], tok, limit)
    assert prompts.skipped == 1 and prompts.order == [3, 1, 0]
    assert [it.index for it in prompts.draw(4)] == [3, 1, 0, 3]
    with pytest.raises(ValueError, match="all 4 training prompts are longer than max_prompt_tokens=1"):
        train.Prompts(task, [0, 1, 2, 3], tok, 1)


@pytest.mark.parametrize("value, valid", [
    (-1, r"an int >= 0 \(0 = all that fits, else 1\.\.model\.max_seq_len - sampling\.max_new_tokens\)"),  # its rule
    (10**6, r"0 \(all that fits\) or 1\.\.56 \(model\.max_seq_len=64 - sampling\.max_new_tokens=8\)"),  # a relation
])
def test_a_max_prompt_tokens_that_leaves_no_room_is_refused(tmp_path, value, valid):
    with pytest.raises(ValueError, match=f"max_prompt_tokens={value}: need {valid}"):
        micro_config(tmp_path, [f"max_prompt_tokens={value}"])


def test_too_few_held_out_prompts_that_fit_is_a_config_error_before_any_work(tmp_path):
    """Found only once the demo tokenizer exists (train.prepare reads the data), yet still before SFT: a
    ConfigError, which train.py prints as one `config error:` line."""
    from config import ConfigError
    cfg = load_config(None, ["model.vocab_size=320", "model.dim=32", "model.n_layers=1", "model.n_heads=2",
                             "model.n_kv_heads=1", "model.head_dim=16", "model.num_experts=2", "model.top_k=2",
                             "model.moe_inter_dim=16", "model.max_seq_len=64", "bpe_merges=40", "train_size=100",
                             "eval_size=8", "max_prompt_tokens=3", "sft_steps=2", "rl_steps=1", f"out_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="eval_size=8: only .* fit max_prompt_tokens=3"):
        train.main(cfg)
    assert not os.path.exists(tmp_path / "metrics.jsonl")  # no SFT step ran


def test_a_run_without_the_eval_before_rl_reaches_its_first_update_sooner_and_reports_after_rl_only(tmp_path, capsys):
    out = tmp_path / "run"
    path = write_config(tmp_path, MICRO + f"out_dir = {str(out)!r}\nrl_steps = 2\n")
    result = train.main(train.parse_args([path, "eval_before_rl=False", "sft_steps=0"]))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["stage"] for r in records] == ["rl", "rl", "eval"]  # RL step 0 first; MICRO's eval_every=2
    assert set(result["sampled"]) == {"rl_acc", "rl_se"}  # no before, no gain
    printed = capsys.readouterr().out
    assert f"{result['optimizer_steps']} optimizer steps in 2 RL steps" in printed and "eval_before_rl off" in printed
