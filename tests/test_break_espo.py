"""Issue 25, cause 9: espo.py's bin sizes, advantages and ESPO's clip against float64 oracles written here.

Each case is one row of a table: ESPO's top-bin size is the exact ceil(n * top_frac) of the decimal
written (fp32 put one token too many in the bin at 0.6 x 25, 0.15 x 100, 0.3 x 50, ...); an all-equal
group's advantages are exactly 0 whatever its value and dtype (the fp32 mean missed 15 x 123.456 by an
ulp, and std + eps turned that into an advantage near 1); at a ratio exactly on its clip bound ESPO passes
the whole gradient, as torch.clamp does in the other losses (its min/max form split it).
"""
import math
from fractions import Fraction

import pytest
import torch

from espo import LossConfig, entropy_bins, group_advantages, policy_loss, ragged_group_advantages

V = 50
ALPHA = 0.5  # wide enough that some random bins clip and some do not


# ----------------------------------------------------------------------------- float64 oracles

def oracle_top(n: int, frac: float) -> int:
    """ceil(frac * n), at least 1, on the decimal frac is written as."""
    return max(1, math.ceil(Fraction(str(frac)) * n))


def oracle_bins(ent_T: list[float], *, top_frac: float, num_bins: int) -> list[int]:
    """Bin of each token of one all-valid sequence: the top ranks first, the rest split evenly."""
    n = len(ent_T)
    ranked = sorted(range(n), key=lambda t: -ent_T[t])  # stable: ties keep position order
    top = oracle_top(n, top_frac)
    bins = [0] * n
    for r, t in enumerate(ranked):
        bins[t] = 0 if r < top else 1 + (r - top) * (num_bins - 1) // max(n - top, 1)
    return bins


def oracle_espo(logp, old, ent, adv, *, top_frac, num_bins, alpha=ALPHA):
    """ESPO loss and its gradient d loss / d logp [B, T], all tokens valid, float64 Python scalars.

    Per bin tau: s = exp(mean log w), eps = alpha * mean e / log V; every token of tau has the value
    min(s A, clip(s) A) and, by the GSPO-token form, the gradient A s unless s is strictly outside its
    clip range on the pessimistic side (then 0): a ratio on the bound keeps the whole gradient."""
    B, T = len(logp), len(logp[0])
    loss, grad = 0.0, [[0.0] * T for _ in range(B)]
    for i in range(B):
        bins = oracle_bins(ent[i], top_frac=top_frac, num_bins=num_bins)
        taus = [[t for t in range(T) if bins[t] == q] for q in sorted(set(bins))]
        for tau in taus:
            s = math.exp(sum(logp[i][t] - old[i][t] for t in tau) / len(tau))
            eps = alpha * sum(ent[i][t] for t in tau) / len(tau) / math.log(V)
            a = adv[i]
            clipped = (a > 0 and s > 1 + eps) or (a < 0 and s < 1 - eps)
            loss -= min(s * a, min(max(s, 1 - eps), 1 + eps) * a) / len(taus) / B
            for t in tau:
                grad[i][t] = 0.0 if clipped else -a * s / len(tau) / len(taus) / B
    return loss, grad


def oracle_advantages(rows: list[list[float]], std_over: str) -> list[list[float]]:
    """(r - mean) / (std + 1e-6) in float64; an all-equal group is exactly 0 (its centred rewards are)."""
    centred = [[0.0] * len(r) if len(set(r)) == 1 else [x - sum(r) / len(r) for x in r] for r in rows]

    def std(xs):
        m = sum(xs) / len(xs)
        return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))
    if std_over == "batch":
        s = std([x for c in centred for x in c])
        return [[x / (s + 1e-6) for x in c] for c in centred]
    return [[x / (std(r) + 1e-6) for x in c] for c, r in zip(centred, rows)]


# ----------------------------------------------------------------------------- the table

# (n tokens, top_frac): fp32's ceil(n * frac) put one token too many in the top bin at each
BIN_CASES = [(25, 0.6), (45, 0.6), (100, 0.15), (180, 0.15), (50, 0.3), (90, 0.3)]
# (value, G, dtype, std_over): an all-equal group whose float mean misses its rewards
EQUAL_CASES = [(123.456, 15, torch.float32, "group"), (123.456, 5, torch.float64, "group"),
               (0.1, 8, torch.float32, "batch"), (0.1, 15, torch.float64, "group"),
               (0.7, 16, torch.float32, "group"), (1 / 3, 8, torch.float64, "batch"),
               (2.2, 15, torch.float32, "group"), (7.77, 5, torch.float64, "group")]
# (advantage sign, bound): a sequence whose ESPO ratio sits exactly on its clip bound
TIE_CASES = [(1.0, "high"), (-1.0, "low"), (1.0, "zero-entropy"), (-1.0, "zero-entropy")]


def random_inputs(B, T, seed):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    logp = old + 0.1 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ent = torch.rand(B, T, generator=g, dtype=torch.float64) * math.log(V)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    return logp, old, ent, adv


@pytest.mark.parametrize("n,top_frac", BIN_CASES)
def test_top_entropy_bin_holds_the_exact_ceil_of_the_written_fraction(n, top_frac):
    _, _, ent, _ = random_inputs(2, n, seed=n)
    got = entropy_bins(ent, torch.ones(2, n), top_frac=top_frac, num_bins=3)
    for i in range(2):
        assert got[i].tolist() == oracle_bins(ent[i].tolist(), top_frac=top_frac, num_bins=3)
    assert int((got[0] == 0).sum()) == oracle_top(n, top_frac)


def test_espo_loss_and_gradient_at_0_6_of_25_tokens_match_the_oracle():
    logp, old, ent, adv = random_inputs(3, 25, seed=25)
    logp.requires_grad_()
    loss, _ = policy_loss(logp, old, adv, torch.ones(3, 25, dtype=torch.float64),
                          LossConfig(espo_top_frac=0.6, espo_alpha=ALPHA), vocab_size=V, old_entropy_BT=ent)
    loss.backward()
    want_loss, want_grad = oracle_espo(logp.tolist(), old.tolist(), ent.tolist(), adv.tolist(), top_frac=0.6,
                                       num_bins=2)
    assert abs(float(loss.detach()) - want_loss) <= 1e-12
    torch.testing.assert_close(logp.grad, torch.tensor(want_grad, dtype=torch.float64), atol=1e-12, rtol=0)


@pytest.mark.parametrize("value,G,dtype,std_over", EQUAL_CASES)
def test_all_equal_group_gets_exactly_zero_advantages(value, G, dtype, std_over):
    other = [0.0, 1.0, 0.25] + [0.5] * (G - 3)  # a group with signal beside it
    rewards = torch.tensor([[value] * G, other], dtype=dtype)
    got = group_advantages(rewards, std_over=std_over)
    assert got.dtype == torch.float32
    assert torch.equal(got[0], torch.zeros(G))
    want = oracle_advantages(rewards.double().tolist(), std_over)
    torch.testing.assert_close(got[1], torch.tensor(want[1], dtype=torch.float32), atol=1e-6, rtol=1e-6)


def test_ragged_batch_std_keeps_all_equal_groups_at_exactly_zero():
    rows = [[123.456] * 15, [0.0, 1.0, 1.0, 0.0], [0.1] * 8, [0.3, 0.9, 0.2]]
    got = ragged_group_advantages([torch.tensor(r) for r in rows], std_over="batch")
    assert torch.equal(got[0], torch.zeros(15)) and torch.equal(got[2], torch.zeros(8))
    want = oracle_advantages([torch.tensor(r).double().tolist() for r in rows], "batch")
    for i in (1, 3):
        torch.testing.assert_close(got[i], torch.tensor(want[i], dtype=torch.float32), atol=1e-6, rtol=1e-6)


def tie_inputs(sign: float, bound: str):
    """One sequence of 2 tokens (num_bins 1) whose ratio s equals its clip bound bit for bit."""
    if bound == "zero-entropy":  # on-policy (s = 1) with certain tokens (eps = 0): both bounds tie
        old = torch.tensor([[-0.7, -1.3]], dtype=torch.float64)
        return old.clone(), old, torch.zeros(1, 2, dtype=torch.float64)
    e = 0.25
    eps = ALPHA * e / math.log(V)
    target = 1 + eps if bound == "high" else 1 - eps
    c = torch.tensor(target, dtype=torch.float64).log()
    for _ in range(64):  # walk to a log ratio whose exp is the bound exactly
        s = float(c.exp())
        if s == target:
            break
        c = torch.nextafter(c, c + (1.0 if s < target else -1.0))
    assert float(c.exp()) == target, "no log ratio lands on the clip bound"
    # old = 0 keeps log w = logp - old = c exact, and (c + c) / 2 = c in the bin mean
    return torch.full((1, 2), float(c), dtype=torch.float64), torch.zeros(1, 2, dtype=torch.float64), \
        torch.full((1, 2), e, dtype=torch.float64)


@pytest.mark.parametrize("sign,bound", TIE_CASES)
def test_espo_ratio_on_its_clip_bound_keeps_the_whole_gradient(sign, bound):
    logp, old, ent = tie_inputs(sign, bound)
    logp.requires_grad_()
    adv = torch.tensor([sign], dtype=torch.float64)
    num_bins = 2 if bound == "zero-entropy" else 1
    loss, _ = policy_loss(logp, old, adv, torch.ones_like(old), LossConfig(espo_alpha=ALPHA, espo_num_bins=num_bins),
                          vocab_size=V, old_entropy_BT=ent)
    loss.backward()
    want_loss, want_grad = oracle_espo(logp.tolist(), old.tolist(), ent.tolist(), adv.tolist(), top_frac=0.2,
                                       num_bins=num_bins)
    assert abs(float(loss.detach()) - want_loss) <= 1e-15
    torch.testing.assert_close(logp.grad, torch.tensor(want_grad, dtype=torch.float64), atol=1e-15, rtol=0)
