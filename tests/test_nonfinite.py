"""A NaN or inf stops the run, loudly, before the optimizer step it would poison; padding holds anything.

- optimizer_step refuses a non-finite loss or gradient norm before opt.step(): the weights and AdamW's
  moments stay as they were, and NonFiniteError names the quantity, the phase and the step;
- a NaN sequence advantage stops an RL step before any forward; the RL-ZVP token advantages that
  temperature 0 turns to NaN (a known defect: it once wrote an all-NaN model and exited 0) stop it
  before its first optimizer step;
- policy_loss and the trainer's RL and SFT losses give the same value and gradients, bitwise, when
  every masked position (prompt, padding) of their inputs holds NaN or inf;
- `python train.py` stopped by one exits non-zero with one line naming the step, the quantity and the
  newest checkpoint, whose weights are finite; no final model is written.
(tests/test_checkpoint.py: a run stopped by a NaN resumes from that checkpoint bitwise.)
"""
import copy
import dataclasses
import math
import os
import re
import subprocess
import sys

import pytest
import torch

import checkpoint
import train
from config import TrainConfig
from espo import LOSS_TYPES, LossConfig, policy_loss
from logprobs import NO_TARGET
from model import Transformer
from runs import MICRO, ParityTask, make_run, micro_config
from trainer import NonFiniteError, optimizer_step, sft_step, train_on_rollouts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def snapshot(model, opt) -> list[torch.Tensor]:
    """Copies of every weight and every optimizer state tensor."""
    state = [t for s in opt.state_dict()["state"].values() for t in s.values()]
    return [p.detach().clone() for p in model.parameters()] + [t.clone() for t in state]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("value", [math.nan, math.inf])
@pytest.mark.parametrize("quantity", ["loss", "grad_norm"])
def test_optimizer_step_refuses_a_non_finite_loss_or_grad_norm_before_stepping(quantity, value):
    cfg = TrainConfig()
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optimizer_step(model, opt, cfg, 0.1, 1.0, stage="rl", step=6)  # a good step: AdamW holds moments now
    before = snapshot(model, opt)
    model(torch.randn(2, 4)).sum().backward()
    loss = 1.0
    if quantity == "grad_norm":
        model.weight.grad[0, 0] = value
    else:
        loss = value
    with pytest.raises(NonFiniteError, match=f"non-finite {quantity} .* at rl step 7") as stop:
        optimizer_step(model, opt, cfg, 0.1, loss, stage="rl", step=7)
    assert (stop.value.quantity, stop.value.stage, stop.value.step) == (quantity, "rl", 7)
    assert same(snapshot(model, opt), before)


def poison_masked_positions(model):
    """Make model's logprobs NaN and entropies inf wherever the target is NO_TARGET (prompt, padding)."""
    def hook(module, args, out):
        (logp_BT, entropy_BT), routes = out
        masked_BT = args[1] == NO_TARGET
        return (logp_BT.masked_fill(masked_BT, math.nan), entropy_BT.masked_fill(masked_BT, math.inf)), routes
    model.register_forward_hook(hook)
    return model


def test_sft_step_names_its_step_and_leaves_the_weights_untouched(tmp_path):
    run = make_run(micro_config(tmp_path))
    model = poison_masked_positions(run.model)
    torch.nn.init.constant_(model.lm_head.weight, math.inf)  # every logprob NaN: the completion's too
    opt = train.sft_optimizer(model, run.cfg)
    before = snapshot(model, opt)
    with pytest.raises(NonFiniteError, match="non-finite loss .* at sft step 3"):
        sft_step(model, opt, [[5, 6, 7, 8, 9], [5, 6, 7]], [2, 1], run.tok.pad_id, 1e-3, run.cfg, step=3)
    assert same(snapshot(model, opt), before)


def test_a_nan_sequence_advantage_stops_the_rl_step_before_any_forward(tmp_path):
    run = make_run(micro_config(tmp_path, ["sampling.temperature=1.5"]))
    _, batch = train.collect_rollouts(run, 4)
    batch.adv_B[1] = math.nan
    forwards = []
    run.model.register_forward_hook(lambda *_: forwards.append(1))
    before = snapshot(run.model, run.opt)
    with pytest.raises(NonFiniteError, match=r"non-finite advantages \(1 values\) at rl step 4"):
        train_on_rollouts(run.model, run.opt, batch, 4, run.cfg)
    assert not forwards and same(snapshot(run.model, run.opt), before)


class AllWrong(ParityTask):
    """Every completion scores 0: every group is zero-variance, so RL-ZVP gives every sequence token advantages."""

    def score(self, completion, item):
        return 0.0


def test_temperature_zero_nan_token_advantages_stop_the_rl_step_before_its_optimizer_step(tmp_path):
    run = make_run(micro_config(tmp_path, ["sampling.temperature=1.5", "filter.zero_variance=rl-zvp"]), task=AllWrong())
    _, batch = train.collect_rollouts(run, 0)
    assert batch.zvp and all(not correct for correct in batch.zvp.values())
    before = snapshot(run.model, run.opt)
    # the trainer's logits / 0: NaN logprobs and entropies (SamplingParams allows 0; only a run's config refuses it)
    cfg = dataclasses.replace(run.cfg, sampling=dataclasses.replace(run.cfg.sampling, temperature=0.0))
    with pytest.raises(NonFiniteError, match="non-finite advantages .* at rl step 0") as stop:
        train_on_rollouts(run.model, run.opt, batch, 0, cfg)
    assert stop.value.quantity == "advantages"
    assert same(snapshot(run.model, run.opt), before)


# ----------------------------------------------------------------------------- masked positions hold anything

def loss_inputs(poison: float, B=4, T=9, seed=0) -> dict:
    """policy_loss inputs with prompt and padding positions (mask 0) holding `poison`; the rest
    random and the same whatever the poison. adv: token advantages [B, T]; adv_B: one per sequence."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([T, 6, 3, 0])  # the last sequence has no completion token at all
    mask_BT = (torch.arange(T)[None] < lengths[:, None]).float()
    mask_BT[1, :2] = 0  # prompt positions before a completion
    old_BT = -torch.rand(B, T, generator=g) * 3

    def fill(x_BT):
        return torch.where(mask_BT.bool(), x_BT, poison)

    adv_B = torch.randn(B, generator=g)
    return dict(logp=fill(old_BT + 0.3 * torch.randn(B, T, generator=g)).requires_grad_(), old=fill(old_BT),
                adv_B=adv_B, adv=fill(adv_B[:, None] + 0.1 * torch.randn(B, T, generator=g)),
                mask=mask_BT, ent=fill(torch.rand(B, T, generator=g) * 3),
                ref=fill(old_BT + 0.2 * torch.randn(B, T, generator=g)),
                infer=fill(old_BT + 0.5 * torch.randn(B, T, generator=g)))


@pytest.mark.parametrize("extra", [dict(kl_coef=0.1, tis_cap=2.0), dict(kl_coef=0.1, kl_estimator="k1",
                                                                        icepop=(0.5, 5.0))])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_policy_loss_value_and_gradient_ignore_nan_and_inf_at_masked_positions(loss_type, extra):
    results = []
    for poison in (0.0, math.nan, math.inf, -math.inf):
        b = loss_inputs(poison)
        adv = b["adv_B"] if loss_type == "gmpo" else b["adv"]  # GMPO takes one advantage per sequence
        cfg = LossConfig(type=loss_type, **extra)
        # Dr.GRPO's seq-mean-token-sum-norm divides by sequences x the generation budget (16 tokens)
        normalizer = len(adv) * 16 if cfg.aggregation_name == "seq-mean-token-sum-norm" else None
        loss, metrics = policy_loss(b["logp"], b["old"], adv, b["mask"], cfg, vocab_size=50, old_entropy_BT=b["ent"],
                                    ref_logp_BT=b["ref"], infer_logp_BT=b["infer"], normalizer=normalizer)
        loss.backward()
        results.append((loss.detach(), b["logp"].grad, metrics))
    clean = results[0]
    assert torch.isfinite(clean[0]) and torch.isfinite(clean[1]).all()
    for got in results[1:]:
        assert torch.equal(got[0], clean[0]) and torch.equal(got[1], clean[1]) and got[2] == clean[2]


def test_the_trainers_rl_update_ignores_nan_and_inf_at_masked_positions(tmp_path):
    """Two mini-batches (pi_old from a no-grad pass and from the loss's own forward), RL-ZVP token
    advantages: the metrics and the weights after the update are bitwise those of a clean model."""
    run = make_run(micro_config(tmp_path, ["sampling.temperature=1.5", "num_minibatches=2",
                                           "filter.zero_variance=rl-zvp"]))
    _, batch = train.collect_rollouts(run, 0)
    out = []
    for poison in (False, True):
        model = copy.deepcopy(run.model)
        if poison:
            poison_masked_positions(model)
        opt = torch.optim.AdamW(model.parameters(), lr=run.cfg.lr)
        m = train_on_rollouts(model, opt, copy.deepcopy(batch), 0, run.cfg)
        out.append((m, [p.detach() for p in model.parameters()]))
    assert all(math.isfinite(v) for v in out[0][0].values())
    assert out[1][0] == out[0][0] and same(out[1][1], out[0][1])


def test_the_sft_loss_ignores_nan_and_inf_at_masked_positions(tmp_path):
    run = make_run(micro_config(tmp_path))
    seqs, starts = [[5, 6, 7, 8, 9, 10], [5, 6, 7], [5, 6, 7, 8]], [2, 1, 3]  # prompt positions and padding
    out = []
    for poison in (False, True):
        model = copy.deepcopy(run.model)
        if poison:
            poison_masked_positions(model)
        opt = train.sft_optimizer(model, run.cfg)
        loss = sft_step(model, opt, seqs, starts, run.tok.pad_id, 1e-3, run.cfg, step=0)
        out.append((loss, [p.detach() for p in model.parameters()]))
    assert math.isfinite(out[0][0]) and out[1][0] == out[0][0] and same(out[1][1], out[0][1])


# ----------------------------------------------------------------------------- the script's exit

# The training script with the trainer's forward at temperature 0 (the known defect's NaN); SFT
# does not go through policy_logprobs, so the first RL step is the first to see it.
TRAINER_AT_TEMPERATURE_ZERO = """
import dataclasses, runpy, sys
sys.path.insert(0, {root!r})
import trainer
real = trainer.policy_logprobs
trainer.policy_logprobs = lambda model, batch, idx, cfg: real(
    model, batch, idx, dataclasses.replace(cfg, sampling=dataclasses.replace(cfg.sampling, temperature=0.0)))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_a_run_stopped_by_a_nan_exits_nonzero_with_one_line_naming_step_quantity_and_last_good_checkpoint(tmp_path):
    path, out = tmp_path / "cfg.py", tmp_path / "run"
    path.write_text(MICRO)
    args = [os.path.join(ROOT, "train.py"), str(path), f"out_dir={out}", "sft_steps=2", "ckpt_every=2",
            "filter.zero_variance=rl-zvp", "sampling.temperature=1.5", "eval_size=8", "eval_samples=1"]
    done = subprocess.run([sys.executable, "-c", TRAINER_AT_TEMPERATURE_ZERO.format(root=ROOT), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    newest = out / "ckpt" / "step_00000002"  # after the 2 SFT steps
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert re.fullmatch(rf"stopped: non-finite (advantages|loss) \(.*\) at rl step 0; the newest checkpoint "
                        rf"\({re.escape(str(newest))}\) is the last good state", last), last
    assert "Traceback" not in done.stderr
    assert os.listdir(out / "ckpt") == ["step_00000002"] and not (out / "model.safetensors").exists()
    cfg = train.parse_args([str(path), f"out_dir={out}"])
    model = Transformer(cfg.model)
    checkpoint.read_checkpoint(str(newest), model, train.sft_optimizer(model, cfg))
    assert all(torch.isfinite(p).all() for p in model.parameters())
