"""The loss mask over a completion (issue 34.4): a tool's response is fed to the model but never trained,
so every consumer of the trainer's mask sees the sampled tokens only."""
import copy

import pytest
import torch

from config import TrainConfig
from espo import LossConfig, entropy_bins, policy_loss
from logprobs import NO_TARGET, token_entropy, token_logprobs
from model import Transformer
from sampler import Rollout
from trainer import TrainBatch, minibatch_backward, sequence_batch, train_on_rollouts

PROMPTS = [[3, 4, 5], [6, 7, 8, 9], [10, 11]]
COMPLETIONS = [[12, 13, 14, 15, 16, 17, 18], [19, 20, 21, 22, 23], [24, 25, 26, 27, 28, 29]]
# sequence 0: a tool's response in the middle; 1: all sampled (None); 2: two tool tokens apart
MASKS = [[1, 1, 0, 0, 0, 1, 1], None, [1, 0, 1, 1, 0, 1]]


def make_batch(tiny_cfg, masks=MASKS, infer_logp=None, zvp=None) -> TrainBatch:
    L, K = tiny_cfg.num_moe_layers, tiny_cfg.top_k
    seqs = [p + c for p, c in zip(PROMPTS, COMPLETIONS)]
    g = torch.Generator().manual_seed(1)
    routes = [torch.randint(0, tiny_cfg.num_experts, (len(s) - 1, L, K), generator=g, dtype=torch.int32) for s in seqs]
    if infer_logp is None:
        infer_logp = [-torch.rand(len(c), generator=g) for c in COMPLETIONS]
    return TrainBatch(seqs=seqs, starts=[len(p) for p in PROMPTS], routes=routes, adv_B=torch.tensor([1.0, -0.5, 0.7]),
                      infer_logp=infer_logp, loss_masks=masks, zvp=zvp or {})


def train_cfg(tiny_cfg, **loss) -> TrainConfig:
    return TrainConfig(model=tiny_cfg, num_minibatches=1, loss=LossConfig(**loss))


def test_tool_tokens_are_inputs_with_no_target_and_mask_zero():
    inputs, targets, mask, _ = sequence_batch([[1, 2, 3, 4, 5, 6]], [2], 0, loss_masks=[[1, 0, 0, 1]])
    assert inputs.tolist() == [[1, 2, 3, 4, 5]]  # the tool's tokens 4, 5 are still fed
    assert targets.tolist() == [[NO_TARGET, 3, NO_TARGET, NO_TARGET, 6]]
    assert mask.tolist() == [[0.0, 1.0, 0.0, 0.0, 1.0]]


def test_a_loss_mask_of_the_wrong_length_or_values_is_a_value_error_naming_them(tiny_cfg):
    with pytest.raises(ValueError, match="sequence 1: loss_mask has 4 entries; its completion has 5 tokens"):
        make_batch(tiny_cfg, masks=[None, [1, 1, 0, 1], None])
    with pytest.raises(ValueError, match=r"sequence 0: loss_mask holds \[2\]; valid: 0 and 1"):
        make_batch(tiny_cfg, masks=[[1, 2, 0, 0, 0, 1, 1], None, None])


def test_a_rollout_and_its_summary_count_trained_tokens():
    r = Rollout([1, 2], [3, 4, 5, 6], torch.zeros(4), torch.zeros(0), "stop", 0, 0, loss_mask=[1, 0, 0, 1])
    assert r.num_trained == r.summary(rank=0).num_trained == 2 and r.summary(rank=0).num_tokens == 4
    assert Rollout([1], [3, 4], torch.zeros(2), torch.zeros(0), "stop", 0, 0).num_trained == 2


def test_normaliser_counts_trained_tokens_and_token_mean_loss_is_their_mean(tiny_cfg):
    batch = make_batch(tiny_cfg)
    assert batch.all_lens == [4, 5, 4]
    cfg = train_cfg(tiny_cfg, type="grpo", aggregation="token-mean")
    model = Transformer(tiny_cfg)
    loss, _ = minibatch_backward(model, batch, [0, 1, 2], True, cfg)
    # before any step pi_theta = pi_old: every ratio is 1, each trained token's objective its sequence's advantage
    want = -(1.0 * 4 - 0.5 * 5 + 0.7 * 4) / 13
    assert loss == pytest.approx(want, rel=1e-6)


def test_gradient_equals_the_loss_over_trained_tokens_only_and_is_zero_at_tool_logits(tiny_cfg):
    batch = make_batch(tiny_cfg)
    cfg = train_cfg(tiny_cfg, type="grpo", aggregation="token-mean")
    model = Transformer(tiny_cfg)
    by_hand = copy.deepcopy(model)
    minibatch_backward(model, batch, [0, 1, 2], True, cfg)
    # by hand: every completion target's logprob from the full logits, summed over the trained ones
    inputs, _, _, routes = batch.micro([0, 1, 2], cfg)
    _, all_targets, all_mask, _ = sequence_batch(batch.seqs, batch.starts, 0)  # no loss masks: every completion token
    logits_BTV = by_hand(inputs, routed_experts=routes)[0]
    logp_BT = token_logprobs(logits_BTV, all_targets, cfg.sampling.temperature)
    trained_BT = batch.micro([0, 1, 2], cfg)[2]
    # the ratio's gradient at ratio 1 is the logprob's: d/dθ A exp(logp - sg(logp)) = A d logp
    (-(batch.adv_B[:, None] * logp_BT * trained_BT).sum() / trained_BT.sum()).backward()
    for (name, a), b in zip(model.named_parameters(), by_hand.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-8), name
    tool_BT = all_mask.bool() & ~trained_BT.bool()
    assert tool_BT.sum() == 5
    # the policy loss itself sends exactly 0 to a tool token's logits
    logits_BTV = logits_BTV.detach().requires_grad_()
    logp_BT = token_logprobs(logits_BTV, batch.micro([0, 1, 2], cfg)[1], cfg.sampling.temperature)
    loss, _ = policy_loss(logp_BT, logp_BT.detach(), batch.adv_B, trained_BT, LossConfig(),
                          vocab_size=tiny_cfg.vocab_size, old_entropy_BT=token_entropy(logits_BTV.detach()))
    loss.backward()
    assert (logits_BTV.grad[tool_BT] == 0).all() and (logits_BTV.grad[trained_BT.bool()] != 0).any()


@pytest.mark.parametrize("loss", [{"tis_cap": 2.0}, {"icepop": (0.5, 5.0)}], ids=["tis", "icepop"])
def test_tool_tokens_engine_logprobs_change_nothing(tiny_cfg, loss):
    cfg = train_cfg(tiny_cfg, **loss)
    base = make_batch(tiny_cfg)
    infer = [x.clone() for x in base.infer_logp]
    for x, m in zip(infer, MASKS):
        if m is not None:
            x[torch.tensor(m) == 0] = torch.tensor([float("nan"), -50.0, 3.0, 0.0, float("inf")])[:m.count(0)]
    runs = []
    for batch in (base, make_batch(tiny_cfg, infer_logp=infer)):
        model = Transformer(tiny_cfg) if not runs else copy.deepcopy(runs[0][2])
        start = copy.deepcopy(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        runs.append((train_on_rollouts(model, opt, batch, 0, cfg), model, start))
    (m_a, model_a, _), (m_b, model_b, _) = runs
    assert m_a == m_b and any(k.startswith("mismatch/") for k in m_a)
    for a, b in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(a, b)


def test_espo_bins_and_loss_of_a_masked_row_are_those_of_the_row_without_its_tool_tokens():
    torch.manual_seed(3)
    T = 10
    tool = torch.tensor([0, 0, 1, 1, 1, 0, 0, 0, 1, 0], dtype=torch.bool)
    logp = -torch.rand(1, T, dtype=torch.float64, requires_grad=True)
    old, ent = -torch.rand(1, T, dtype=torch.float64), 5 * torch.rand(1, T, dtype=torch.float64)
    ent[0, tool] = 100.0  # a tool token's entropy (if any were computed) would top every bin
    mask = (~tool).double()[None]
    bins = entropy_bins(ent, mask, top_frac=0.2, num_bins=2)
    keep = ~tool
    assert (bins[0, tool] == -1).all()
    assert torch.equal(bins[0, keep], entropy_bins(ent[:, keep], torch.ones(1, int(keep.sum())), top_frac=0.2,
                                                   num_bins=2)[0])
    cfg = LossConfig()
    masked, _ = policy_loss(logp, old, torch.tensor([0.8]), mask, cfg, vocab_size=64, old_entropy_BT=ent)
    compact, _ = policy_loss(logp[:, keep], old[:, keep], torch.tensor([0.8]), torch.ones(1, int(keep.sum())), cfg,
                             vocab_size=64, old_entropy_BT=ent[:, keep])
    assert masked.item() == pytest.approx(compact.item(), rel=1e-12)


def test_rl_zvp_max_entropy_is_over_trained_tokens_only(tiny_cfg):
    batch = make_batch(tiny_cfg, zvp={0: False})
    n, s = len(batch.seqs[0]) - 1, batch.starts[0] - 1
    ent = torch.rand(1, n)
    tool = torch.zeros(n, dtype=torch.bool)
    tool[s:] = torch.tensor(MASKS[0]) == 0
    ent[0, tool] = 50.0  # far above every trained token's
    batch.set_old([0], torch.zeros(1, n), ent, zvp_alpha=0.1)
    trained = torch.zeros(n, dtype=torch.bool)
    trained[s:] = ~tool[s:]
    h = ent[0, trained]
    assert torch.equal(batch.adv_tokens[0][trained], -0.1 * (h.max() - h))
    assert (batch.adv_tokens[0][~trained] == 0).all()


def test_all_ones_loss_masks_give_bitwise_the_unmasked_step(tiny_cfg):
    cfg = train_cfg(tiny_cfg, tis_cap=2.0)
    results = []
    for masks in (None, [[1] * len(c) for c in COMPLETIONS]):
        torch.manual_seed(0)
        model = Transformer(tiny_cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        batch = make_batch(tiny_cfg, masks=masks, zvp={1: True})
        results.append((train_on_rollouts(model, opt, batch, 0, cfg), [p.detach().clone() for p in model.parameters()]))
    (m_a, p_a), (m_b, p_b) = results
    assert m_a == m_b
    assert all(torch.equal(a, b) for a, b in zip(p_a, p_b))
