"""ESPO and GRPO losses against float64 per-sequence loops written from the equations."""
import math

import pytest
import torch

from espo import entropy_groups, group_advantages, policy_loss

V = 50


def random_batch(B=6, T=13, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T
    mask = (torch.arange(T)[None] < lengths[:, None]).double()
    mask[1, :2] = 0  # a sequence whose completion starts later (prompt positions)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    logp = (old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).requires_grad_()
    ent = torch.rand(B, T, generator=g, dtype=torch.float64) * math.log(V)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    return logp, old, adv, mask, ent


def espo_reference(logp, old, adv, mask, ent, *, alpha, top_frac, num_groups):
    """arXiv 2512.00499: mean over sequences of mean over entropy groups of mean over tokens of
    min(s A, clip(s, 1-eps_tau, 1+eps_tau) A), s = sg[s_tau] pi/sg[pi], s_tau = exp(mean log w)."""
    seq_objs = []
    for i in range(logp.shape[0]):
        toks = [t for t in range(logp.shape[1]) if mask[i, t] > 0]
        ranked = sorted(toks, key=lambda t: -float(ent[i, t]))  # stable: ties keep position order
        n = len(ranked)
        top = max(1, math.ceil(top_frac * n))
        groups = [[] for _ in range(num_groups)]
        for r, t in enumerate(ranked):
            q = 0 if (r < top or num_groups == 1) else 1 + (r - top) * (num_groups - 1) // max(n - top, 1)
            groups[q].append(t)
        group_objs = []
        for tau in groups:
            if not tau:
                continue
            log_s = sum(float((logp[i, t] - old[i, t]).detach()) for t in tau) / len(tau)
            eps = alpha * sum(float(ent[i, t]) for t in tau) / len(tau) / math.log(V)
            terms = []
            for t in tau:
                s = math.exp(log_s) * torch.exp(logp[i, t] - logp[i, t].detach())
                clipped = torch.clamp(s, 1 - eps, 1 + eps)
                terms.append(torch.minimum(s * adv[i], clipped * adv[i]))
            group_objs.append(sum(terms) / len(terms))
        seq_objs.append(sum(group_objs) / len(group_objs) if group_objs else torch.zeros((), dtype=torch.float64))
    return -sum(seq_objs) / len(seq_objs)


def grpo_reference(logp, old, adv, mask, *, eps_low, eps_high):
    """DAPO arXiv 2503.14476 eq. 10: token-mean of min(w A, clip(w, 1-eps_low, 1+eps_high) A)."""
    total, count = 0.0, 0
    for i in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if mask[i, t] > 0:
                w = torch.exp(logp[i, t] - old[i, t])
                total = total + torch.minimum(w * adv[i], torch.clamp(w, 1 - eps_low, 1 + eps_high) * adv[i])
                count += 1
    return -total / count


def value_and_grad(fn, logp):
    logp.grad = None
    loss = fn()
    loss.backward()
    return loss.detach(), logp.grad.clone()


@pytest.mark.parametrize("num_groups,top_frac,alpha", [(2, 0.2, 0.02), (3, 0.3, 0.5), (1, 0.2, 0.3), (2, 0.5, 2.0)])
def test_espo_loss_and_gradient_match_float64_loop_reference(num_groups, top_frac, alpha):
    logp, old, adv, mask, ent = random_batch()
    kw = dict(alpha=alpha, top_frac=top_frac, num_groups=num_groups)
    want_v, want_g = value_and_grad(lambda: espo_reference(logp, old, adv, mask, ent, **kw), logp)
    got_v, got_g = value_and_grad(lambda: policy_loss(
        logp, old, adv, mask, loss_type="espo", old_entropy_BT=ent, vocab_size=V, espo_alpha=alpha,
        espo_top_frac=top_frac, espo_num_groups=num_groups)[0], logp)
    assert abs(float(got_v - want_v)) <= 1e-10
    assert (got_g - want_g).abs().max() <= 1e-10
    assert want_g.abs().sum() > 0


def test_grpo_token_clip_loss_and_gradient_match_float64_loop_reference():
    logp, old, adv, mask, _ = random_batch(seed=1)
    want_v, want_g = value_and_grad(lambda: grpo_reference(logp, old, adv, mask, eps_low=0.2, eps_high=0.28), logp)
    got_v, got_g = value_and_grad(lambda: policy_loss(logp, old, adv, mask, loss_type="grpo")[0], logp)
    assert abs(float(got_v - want_v)) <= 1e-10
    assert (got_g - want_g).abs().max() <= 1e-10


def test_normalizer_splits_a_batch_into_micro_batches_that_add_up():
    logp, old, adv, mask, ent = random_batch()
    kw = dict(loss_type="espo", old_entropy_BT=ent, vocab_size=V)
    whole = policy_loss(logp, old, adv, mask, **kw)[0]
    parts = sum(policy_loss(logp[s], old[s], adv[s], mask[s], loss_type="espo", old_entropy_BT=ent[s],
                            vocab_size=V, normalizer=6)[0] for s in (slice(0, 2), slice(2, 6)))
    assert abs(float((whole - parts).detach())) <= 1e-12


def test_espo_at_ratio_one_has_reinforce_gradient():
    """With pi_theta == pi_old nothing clips: grad = -1/B sum_i A_i mean_groups mean_tokens grad log pi."""
    logp, _, adv, mask, ent = random_batch()
    old = logp.detach().clone()
    _, grad = value_and_grad(lambda: policy_loss(logp, old, adv, mask, loss_type="espo", old_entropy_BT=ent,
                                                 vocab_size=V, espo_num_groups=1)[0], logp)
    want = -adv[:, None] * mask / mask.sum(-1, keepdim=True) / logp.shape[0]
    assert (grad - want).abs().max() <= 1e-12


def test_zero_variance_group_gives_zero_gradient():
    logp, old, _, mask, ent = random_batch()
    adv = group_advantages(torch.ones(1, 6)).flatten().double()  # all six rollouts got the same reward
    _, grad = value_and_grad(lambda: policy_loss(logp, old, adv, mask, loss_type="espo", old_entropy_BT=ent,
                                                 vocab_size=V)[0], logp)
    assert grad.abs().max() == 0


def test_group_advantages_sum_to_zero_and_scale_by_std():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    a = group_advantages(r)
    torch.testing.assert_close(a.sum(1), torch.zeros(3), atol=1e-6, rtol=0)
    torch.testing.assert_close(a[0], (r[0] - 0.5) / (r[0].std() + 1e-6))
    assert torch.equal(group_advantages(r, scale_by_std=False)[2], torch.zeros(4))
    with pytest.raises(ValueError, match="G >= 2"):
        group_advantages(torch.ones(3, 1))


def test_entropy_groups_put_top_fraction_first_and_skip_padding():
    ent = torch.tensor([[0.1, 0.9, 0.5, 0.3, 0.7, 0.2, 0.0, 0.0, 0.0, 0.4, 9.0]])
    mask = torch.ones(1, 11)
    mask[0, 10] = 0
    g = entropy_groups(ent, mask, top_frac=0.2, num_groups=2)
    assert g[0].tolist() == [1, 0, 1, 1, 0, 1, 1, 1, 1, 1, -1]  # ceil(0.2 * 10) = 2 top tokens


def test_unknown_loss_type_is_a_value_error():
    logp, old, adv, mask, ent = random_batch()
    with pytest.raises(ValueError, match="loss_type"):
        policy_loss(logp, old, adv, mask, loss_type="ppo")
    with pytest.raises(ValueError, match="old_entropy"):
        policy_loss(logp, old, adv, mask, loss_type="espo")
