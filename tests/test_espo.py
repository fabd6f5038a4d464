"""The policy losses of espo.py against float64 per-sequence loops written from the papers
(tests/reference_losses.py), and the invariants that tie the losses together."""
import math

import pytest
import torch

from espo import (AGGREGATIONS, LOSS_TYPES, LossConfig, entropy_bins, group_advantages, mismatch_metrics, policy_loss)
from reference_losses import espo_bins, reference_loss

V = 50
TOL = 1e-10
TOKEN_AGGS = [a for a in AGGREGATIONS if a != "seq-mean-bin-mean-token-mean"]
MAX_TOKENS = 16  # Dr.GRPO's generation budget in these tests (>= T): its normalizer is sequences x MAX_TOKENS
# clip ranges wide enough that some tokens (or sequences) clip and some do not on random_batch
TEST_EPS = {"grpo": (0.2, 0.28), "drgrpo": (0.2, 0.2), "gspo": (0.04, 0.06), "gspo-token": (0.04, 0.06),
            "gmpo": (0.3, 0.4), "cispo": (0.3, 0.2)}
PAPER_AGG = {"grpo": "token-mean", "drgrpo": "seq-mean-token-sum-norm", "gspo": "seq-mean-token-mean",
             "gspo-token": "seq-mean-token-mean", "gmpo": "seq-mean-token-mean", "cispo": "token-mean",
             "espo": "seq-mean-bin-mean-token-mean"}


def random_batch(B=6, T=13, seed=0):
    """float64 inputs with varied lengths, one sequence starting late and one with no valid token."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0], lengths[2] = T, 0
    mask = (torch.arange(T)[None] < lengths[:, None]).double()
    mask[1, :2] = 0  # a sequence whose completion starts later (prompt positions)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    logp = (old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).requires_grad_()
    ent = torch.rand(B, T, generator=g, dtype=torch.float64) * math.log(V)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    ref = old + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    infer = old + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)  # some k = pi_old/pi_infer outside [0.5, 2]
    return dict(logp=logp, old=old, adv=adv, mask=mask, ent=ent, ref=ref, infer=infer)


def value_and_grad(fn, logp):
    logp.grad = None
    loss = fn()
    loss.backward()
    return loss.detach(), logp.grad.clone()


POLICY_LOSS_ARGS = ("vocab_size", "old_entropy_BT", "ref_logp_BT", "infer_logp_BT", "normalizer")


def loss_call(b, max_tokens=None, **kw):
    """espo.policy_loss on batch b with kw split into LossConfig fields and policy_loss's own arguments.

    max_tokens: Dr.GRPO's generation budget; when the aggregation in use is seq-mean-token-sum-norm and no
    normalizer is given, the normalizer is b's sequences x max_tokens (none without max_tokens)."""
    args = {k: kw.pop(k) for k in POLICY_LOSS_ARGS if k in kw}
    cfg = LossConfig(**kw)
    if max_tokens is not None and "normalizer" not in args and cfg.aggregation_name == "seq-mean-token-sum-norm":
        args["normalizer"] = b["mask"].shape[0] * max_tokens
    return policy_loss(b["logp"], b["old"], b["adv"], b["mask"], cfg, **args)


def ours(b, loss_type, **kw):
    """espo.policy_loss on batch b: (loss, metrics)."""
    eps = TEST_EPS.get(loss_type, (None, None))
    kw = {"clip_eps_low": eps[0], "clip_eps_high": eps[1], "max_tokens": MAX_TOKENS, "old_entropy_BT": b["ent"],
          "vocab_size": V, **kw}
    return loss_call(b, type=loss_type, **kw)


def reference(b, loss_type, aggregation, **kw):
    eps = TEST_EPS.get(loss_type, (0.2, 0.28))
    kw = {"eps_low": eps[0], "eps_high": eps[1], "max_tokens": MAX_TOKENS, "ent": b["ent"], "vocab_size": V, **kw}
    return reference_loss(loss_type, b["logp"], b["old"], b["adv"], b["mask"], aggregation=aggregation, **kw)


def assert_parity(b, loss_type, aggregation, ours_kw=None, ref_kw=None):
    want_v, want_g = value_and_grad(lambda: reference(b, loss_type, aggregation, **(ref_kw or {})), b["logp"])
    got_v, got_g = value_and_grad(lambda: ours(b, loss_type, aggregation=aggregation, **(ours_kw or {}))[0], b["logp"])
    assert abs(float(got_v - want_v)) <= TOL
    assert (got_g - want_g).abs().max() <= TOL
    assert want_g.abs().sum() > 0


# ----------------------------------------------------------------------------- parity with the papers

@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_each_loss_and_gradient_match_float64_paper_reference_in_its_paper_aggregation(loss_type):
    b = random_batch(seed=1)
    assert_parity(b, loss_type, PAPER_AGG[loss_type])
    m = ours(b, loss_type)[1]  # aggregation=None is the paper's: same value as above
    assert 0 < m["clip_frac_low"] + m["clip_frac_high"] < 1, "the parity test should exercise both branches"


@pytest.mark.parametrize("aggregation", TOKEN_AGGS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_aggregation_matches_float64_loop_reference(loss_type, aggregation):
    assert_parity(random_batch(seed=2), loss_type, aggregation)


@pytest.mark.parametrize("num_bins,top_frac,alpha", [(2, 0.2, 0.02), (3, 0.3, 0.5), (1, 0.2, 0.3), (2, 0.5, 2.0)])
def test_espo_bins_and_adaptive_clip_match_float64_loop_reference(num_bins, top_frac, alpha):
    assert_parity(random_batch(), "espo", "seq-mean-bin-mean-token-mean",
                  ours_kw=dict(espo_alpha=alpha, espo_top_frac=top_frac, espo_num_bins=num_bins),
                  ref_kw=dict(alpha=alpha, top_frac=top_frac, num_bins=num_bins))


@pytest.mark.parametrize("estimator", ["k1", "k3"])
@pytest.mark.parametrize("loss_type", ["grpo", "gspo", "espo"])
def test_kl_penalty_matches_float64_loop_reference(loss_type, estimator):
    b = random_batch(seed=3)
    assert_parity(b, loss_type, PAPER_AGG[loss_type], ours_kw=dict(ref_logp_BT=b["ref"], kl_coef=0.1, kl_estimator=estimator),
                  ref_kw=dict(ref=b["ref"], kl_coef=0.1, kl_estimator=estimator))


@pytest.mark.parametrize("correction", ["tis", "icepop"])
@pytest.mark.parametrize("loss_type", ["grpo", "gspo-token", "cispo", "espo"])
def test_tis_and_icepop_match_float64_loop_reference(loss_type, correction):
    b = random_batch(seed=4)
    ours_kw = dict(tis_cap=2.0) if correction == "tis" else dict(icepop=(0.5, 2.0))
    ref_kw = dict(tis_cap=2.0) if correction == "tis" else dict(icepop=(0.5, 2.0))
    assert_parity(b, loss_type, PAPER_AGG[loss_type], ours_kw=dict(infer_logp_BT=b["infer"], **ours_kw),
                  ref_kw=dict(infer=b["infer"], **ref_kw))
    frac = ours(b, loss_type, infer_logp_BT=b["infer"], **ours_kw)[1]
    assert 0 < frac.get("mismatch/tis_truncated_frac", frac.get("mismatch/icepop_masked_frac")) < 1


@pytest.mark.parametrize("loss_type,eps", [("grpo", (0.2, 0.28)), ("drgrpo", (0.2, 0.2)), ("gspo", (3e-4, 4e-4)),
                                           ("gspo-token", (3e-4, 4e-4)), ("gmpo", (0.4, 0.4)), ("cispo", (1.0, 0.28))])
def test_default_clip_ranges_are_the_papers(loss_type, eps):
    b = random_batch(seed=5)
    want = reference(b, loss_type, PAPER_AGG[loss_type], eps_low=eps[0], eps_high=eps[1])
    got = loss_call(b, type=loss_type, max_tokens=MAX_TOKENS)[0]
    assert abs(float((got - want).detach())) <= TOL


# ----------------------------------------------------------------------------- invariants

@pytest.mark.parametrize("loss_type,aggregation", [(t, a) for t in LOSS_TYPES for a in TOKEN_AGGS]
                         + [("espo", "seq-mean-bin-mean-token-mean")])
def test_at_ratio_one_every_loss_has_the_reinforce_gradient_of_its_aggregation(loss_type, aggregation):
    b = random_batch(seed=6)
    b["old"] = b["logp"].detach().clone()  # pi_theta == pi_old: every ratio is 1, inside every clip range
    _, want = value_and_grad(lambda: reference(b, "reinforce", aggregation), b["logp"])
    _, got = value_and_grad(lambda: ours(b, loss_type, aggregation=aggregation)[0], b["logp"])
    assert (got - want).abs().max() <= 1e-12


@pytest.mark.parametrize("aggregation", TOKEN_AGGS)
def test_gspo_token_value_and_gradient_equal_gspo(aggregation):
    b = random_batch(seed=7)
    v_seq, g_seq = value_and_grad(lambda: ours(b, "gspo", aggregation=aggregation)[0], b["logp"])
    v_tok, g_tok = value_and_grad(lambda: ours(b, "gspo-token", aggregation=aggregation)[0], b["logp"])
    assert abs(float(v_seq - v_tok)) <= 1e-12
    assert (g_seq - g_tok).abs().max() <= 1e-12


def test_espo_with_one_entropy_bin_is_gspo_token_with_the_adaptive_clip():
    """One bin: s_tau = s_i, eps_tau = alpha * mean entropy / log|V| per sequence; the bin mean is the token mean."""
    b, alpha = random_batch(seed=8), 0.3
    v_espo, g_espo = value_and_grad(lambda: ours(b, "espo", espo_num_bins=1, espo_alpha=alpha)[0], b["logp"])
    B = b["mask"].shape[0]

    def gspo_token_per_sequence():
        total = 0.0
        for i in range(B):
            n = b["mask"][i].sum()
            eps = float(alpha * (b["ent"][i] * b["mask"][i]).sum() / n.clamp(min=1) / math.log(V))
            row = {k: b[k][i:i + 1] for k in ("logp", "old", "adv", "mask")}
            total = total + loss_call(row, type="gspo-token", clip_eps_low=eps, clip_eps_high=eps,
                                      aggregation="seq-mean-token-mean", normalizer=B)[0]
        return total

    v_gspo, g_gspo = value_and_grad(gspo_token_per_sequence, b["logp"])
    assert abs(float(v_espo - v_gspo)) <= 1e-12
    assert (g_espo - g_gspo).abs().max() <= 1e-12
    assert ours(b, "espo", espo_num_bins=1, espo_alpha=alpha)[1]["clip_frac_low"] > 0  # the clip was exercised


@pytest.mark.parametrize("scale_by_std,std_over", [(True, "group"), (True, "batch"), (False, "group")])
def test_group_advantages_sum_to_zero_within_each_group(scale_by_std, std_over):
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0], [0.3, 0.9, 0.1, 0.5]])
    a = group_advantages(r, scale_by_std=scale_by_std, std_over=std_over)
    torch.testing.assert_close(a.sum(1), torch.zeros(4), atol=1e-6, rtol=0)
    assert torch.equal(a[2], torch.zeros(4))  # all rewards equal: no signal


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_zero_variance_group_gives_zero_gradient(loss_type):
    b = random_batch()
    b["adv"] = group_advantages(torch.ones(1, 6)).flatten().double()  # all six rollouts got the same reward
    _, grad = value_and_grad(lambda: ours(b, loss_type)[0], b["logp"])
    assert grad.abs().max() == 0


@pytest.mark.parametrize("loss_type,aggregation", [(t, PAPER_AGG[t]) for t in LOSS_TYPES] + [("gspo", "token-mean")])
def test_normalizer_splits_a_batch_into_micro_batches_that_add_up(loss_type, aggregation):
    b = random_batch()
    whole = ours(b, loss_type, aggregation=aggregation)[0]
    norm = (b["mask"].sum() if aggregation == "token-mean" else 6 * MAX_TOKENS
            if aggregation == "seq-mean-token-sum-norm" else 6)  # Dr.GRPO's: sequences x the generation budget
    parts = sum(ours({k: v[s] for k, v in b.items()}, loss_type, aggregation=aggregation, normalizer=norm)[0]
                for s in (slice(0, 2), slice(2, 6)))
    assert abs(float((whole - parts).detach())) <= 1e-12


# ----------------------------------------------------------------------------- advantages, entropy bins, metrics

def test_group_advantages_divide_by_the_group_or_the_batch_std():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
    torch.testing.assert_close(group_advantages(r)[0], (r[0] - 0.5) / (r[0].std() + 1e-6))
    centred = r - r.mean(1, keepdim=True)
    torch.testing.assert_close(group_advantages(r, std_over="batch"), centred / (centred.std() + 1e-6))
    torch.testing.assert_close(group_advantages(r, scale_by_std=False), centred)


def test_entropy_bins_put_top_fraction_first_and_skip_padding():
    ent = torch.tensor([[0.1, 0.9, 0.5, 0.3, 0.7, 0.2, 0.0, 0.0, 0.0, 0.4, 9.0]])
    mask = torch.ones(1, 11)
    mask[0, 10] = 0
    g = entropy_bins(ent, mask, top_frac=0.2, num_bins=2)
    assert g[0].tolist() == [1, 0, 1, 1, 0, 1, 1, 1, 1, 1, -1]  # ceil(0.2 * 10) = 2 top tokens


def test_entropy_bins_match_the_reference_ranking_for_three_bins():
    b = random_batch(seed=9)
    g = entropy_bins(b["ent"], b["mask"], top_frac=0.3, num_bins=3)
    for i in range(g.shape[0]):
        toks = [t for t in range(g.shape[1]) if b["mask"][i, t] > 0]
        want = espo_bins(b["ent"], i, toks, top_frac=0.3, num_bins=3)
        assert [int(g[i, t]) for t in toks] == [want[t] for t in toks]


def test_clip_fractions_count_tokens_on_the_clipped_side():
    old = torch.zeros(2, 4, dtype=torch.float64)
    ratios = torch.tensor([[0.5, 1.0, 1.5, 1.1], [0.5, 1.0, 1.5, 1.1]], dtype=torch.float64)
    mask = torch.ones(2, 4, dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    m = policy_loss(ratios.log(), old, adv, mask, LossConfig(type="grpo", clip_eps_low=0.2, clip_eps_high=0.28))[1]
    # A > 0 clips only above 1.28 (the 1.5), A < 0 only below 0.8 (the 0.5)
    assert m["clip_frac_high"] == 1 / 8 and m["clip_frac_low"] == 1 / 8
    assert (m["ratio_min"], m["ratio_max"]) == (0.5, 1.5) and abs(m["ratio_mean"] - 1.025) < 1e-12


def test_metrics_report_entropy_bin_sizes_kl_and_mismatch():
    b = random_batch()
    m = ours(b, "espo", espo_num_bins=3, ref_logp_BT=b["ref"], kl_coef=0.1, infer_logp_BT=b["infer"], tis_cap=2.0)[1]
    assert sum(m[f"espo/bin{q}_tokens"] for q in range(3)) == b["mask"].sum()
    assert m["espo/bin0_clip_eps"] > m["espo/bin2_clip_eps"] > 0  # high-entropy tokens get the wider clip
    assert m["kl_ref"] > 0 and m["approx_kl"] > 0 and 0 < m["mismatch/tis_truncated_frac"] < 1


def test_bad_options_are_value_errors():
    b = random_batch()
    cases = [
        (dict(type="ppo"), "type='ppo'"),
        (dict(type="espo", old_entropy_BT=b["ent"]), "vocab_size"),
        (dict(type="espo", vocab_size=V), "old_entropy"),
        (dict(type="grpo", aggregation="sum"), "aggregation"),
        (dict(type="gspo", aggregation="seq-mean-bin-mean-token-mean"), "entropy bins"),
        (dict(type="drgrpo"), "normalizer = sequences x max_tokens"),
        (dict(type="grpo", clip_eps_low=-0.1), "clip_eps_low"),
        (dict(type="grpo", kl_coef=0.1), "ref_logp"),
        (dict(type="grpo", kl_estimator="k7"), "kl_estimator"),
        (dict(type="grpo", tis_cap=2.0), "infer_logp"),
        (dict(type="grpo", infer_logp_BT=b["infer"], tis_cap=2.0, icepop=(0.5, 2.0)), "one mismatch correction"),
        (dict(type="grpo", infer_logp_BT=b["infer"], icepop=(2.0, 0.5)), "icepop"),
    ]
    for kw, match in cases:
        with pytest.raises(ValueError, match=match):
            loss_call(b, **kw)
    with pytest.raises(ValueError, match="G >= 2"):
        group_advantages(torch.ones(3, 1))
    with pytest.raises(ValueError, match="std_over"):
        group_advantages(torch.ones(3, 2), std_over="prompt")


# ----------------------------------------------------------------------------- mismatch metrics

def test_mismatch_metrics_are_zero_for_identical_policies_and_count_route_flips():
    lp = [torch.tensor([-1.0, -2.0]), torch.tensor([-0.5])]
    routes = [torch.tensor([[[0, 1], [2, 3]], [[4, 5], [6, 7]]]), torch.tensor([[[1, 0], [3, 2]]])]  # [T, L=2, K=2]
    m = mismatch_metrics(lp, lp, infer_routes=routes, trainer_routes=routes)
    assert m["mismatch/kl"] == 0 and m["mismatch/max_abs_logp"] == 0 and m["mismatch/route_diff"] == 0
    flipped = [routes[0].clone(), torch.tensor([[[1, 0], [3, 5]]])]  # order ignored; layer 1 of the last token differs
    flipped[0][0, 1] = torch.tensor([-1, -1])  # a padding row does not count
    m = mismatch_metrics(lp, [x + 0.1 for x in lp], infer_routes=routes, trainer_routes=flipped)
    assert m["mismatch/route_diff/layer0"] == 0 and m["mismatch/route_diff/layer1"] == 0.5
    assert abs(m["mismatch/max_abs_logp"] - 0.1) < 1e-6 and abs(m["mismatch/kl"] - (math.exp(0.1) - 1 - 0.1)) < 1e-6


def test_mismatch_kl_is_k3_of_kl_from_the_engine_to_pi_old_in_float64():
    """d = log pi_infer - log pi_old: k3 of KL(pi_infer || pi_old) is exp(-d) - 1 + d (the samples are
    pi_infer's), not exp(d) - 1 - d; at |d| = 1e-4 float32 would lose it to cancellation (~d^2/2 = 5e-9)."""
    infer = [torch.tensor([-1.0, -2.0], dtype=torch.float32)]
    old = [torch.tensor([-1.0001, -1.5], dtype=torch.float32)]
    d = (infer[0].double() - old[0].double())
    m = mismatch_metrics(infer, old)
    assert m["mismatch/kl"] == pytest.approx(float((torch.exp(-d) - 1 + d).mean()), rel=1e-12)
    assert abs(m["mismatch/kl"] - float((torch.exp(d) - 1 - d).mean())) > 1e-3  # the inverted ratio differs
    tiny = mismatch_metrics([infer[0][:1]], [old[0][:1]])["mismatch/kl"]
    assert tiny == pytest.approx(float(d[0]) ** 2 / 2, rel=1e-3)
