"""Float64 per-sequence loop references of the policy losses, written from the papers' equations.

Independent of espo.py: a Python loop over sequences and their valid tokens, scalar
tensor ops only (autograd flows into logp). Each `*_terms` function gives the paper's
per-token integrand of one sequence; `reference_loss` weights it (TIS / IcePop),
subtracts the KL penalty and averages it as the aggregation names. tests/test_espo.py
checks espo.py against these to 1e-10; bench/loss.py times them as the naive baseline.

Inputs are [B, T] float64 tensors: logp (requires grad), old, mask, ent, ref, infer; adv [B].
"""

import math
from fractions import Fraction

import torch


def grpo_terms(logp, old, adv, i, toks, *, eps_low, eps_high, **_):
    """GRPO arXiv 2402.03300 eq. 3 with DAPO's decoupled range (arXiv 2503.14476 eq. 8):
    min(w_t A_i, clip(w_t, 1 - eps_low, 1 + eps_high) A_i), w_t = pi_theta(y_t) / pi_old(y_t).
    The paper's aggregation: DAPO's token-mean, 1 / sum_i |o_i| sum_i sum_t."""
    terms = {}
    for t in toks:
        w = torch.exp(logp[i, t] - old[i, t])
        terms[t] = torch.minimum(w * adv[i], torch.clamp(w, 1 - eps_low, 1 + eps_high) * adv[i])
    return terms


def drgrpo_terms(logp, old, adv, i, toks, *, eps_low, eps_high, **_):
    """Dr.GRPO arXiv 2503.20783 sec. 3.2: 1/G sum_i sum_t min(w_t A_i, clip(w_t, 1 - eps, 1 + eps) A_i),
    without GRPO's 1/|o_i|; the released code divides the token sum by the generation budget
    (seq-mean-token-sum-norm)."""
    terms = {}
    for t in toks:
        w = torch.exp(logp[i, t] - old[i, t])
        unclipped, clipped = w * adv[i], torch.clamp(w, 1 - eps_low, 1 + eps_high) * adv[i]
        terms[t] = unclipped if unclipped < clipped else clipped
    return terms


def gspo_terms(logp, old, adv, i, toks, *, eps_low, eps_high, **_):
    """GSPO arXiv 2507.18071 eq. 5 and 7: min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i),
    s_i = (pi_theta(y_i) / pi_old(y_i))^(1 / |y_i|); 1/G sum_i, i.e. seq-mean-token-mean of the
    sequence's objective copied onto each of its tokens."""
    if not toks:
        return {}
    log_seq_ratio = sum(logp[i, t] - old[i, t] for t in toks)  # log pi_theta(y_i) / pi_old(y_i)
    s = torch.exp(log_seq_ratio / len(toks))
    obj = torch.minimum(s * adv[i], torch.clamp(s, 1 - eps_low, 1 + eps_high) * adv[i])
    return {t: obj for t in toks}


def gspo_token_terms(logp, old, adv, i, toks, *, eps_low, eps_high, **_):
    """GSPO-token arXiv 2507.18071 eq. 13-14: 1/G sum_i 1/|y_i| sum_t min(s_it A_i, clip(s_it, ...) A_i),
    s_it = sg[s_i] pi_theta(y_t) / sg[pi_theta(y_t)]."""
    if not toks:
        return {}
    s_i = math.exp(sum(float((logp[i, t] - old[i, t]).detach()) for t in toks) / len(toks))  # sg[s_i]
    terms = {}
    for t in toks:
        p = torch.exp(logp[i, t])
        s = s_i * p / p.detach()
        terms[t] = torch.minimum(s * adv[i], torch.clamp(s, 1 - eps_low, 1 + eps_high) * adv[i])
    return terms


def gmpo_terms(logp, old, adv, i, toks, *, eps_low, eps_high, **_):
    """GMPO arXiv 2507.20673 sec. 3: sgn(A_i) (prod_t |min(rho_t A_i, clip(rho_t, e^-eps_low, e^eps_high) A_i)|)^(1/|o_i|),
    token-level clipping; 1/G sum_i (seq-mean-token-mean of the copies)."""
    if not toks:
        return {}
    prod = torch.ones((), dtype=logp.dtype)
    for t in toks:
        rho = torch.exp(logp[i, t] - old[i, t])
        prod = prod * torch.abs(torch.minimum(rho * adv[i], torch.clamp(rho, math.exp(-eps_low), math.exp(eps_high)) * adv[i]))
    obj = prod ** (1.0 / len(toks)) * torch.sign(adv[i])
    return {t: obj for t in toks}


def cispo_terms(logp, old, adv, i, toks, *, eps_low, eps_high, **_):
    """CISPO (MiniMax-M1) arXiv 2506.13585 eq. 4-5: sg(r_hat_t) A_i log pi_theta(y_t),
    r_hat_t = clip(r_t, 1 - eps_low_IS, 1 + eps_high_IS); 1 / sum_i |o_i| sum_i sum_t (token-mean)."""
    terms = {}
    for t in toks:
        r = math.exp(float((logp[i, t] - old[i, t]).detach()))
        terms[t] = min(max(r, 1 - eps_low), 1 + eps_high) * adv[i] * logp[i, t]
    return terms


def reinforce_terms(logp, old, adv, i, toks, **_):
    """REINFORCE (Williams 1992): A_i log pi_theta(y_t); its gradient is the on-policy policy gradient."""
    return {t: adv[i] * logp[i, t] for t in toks}


def espo_bins(ent, i, toks, *, top_frac, num_bins):
    """ESPO arXiv 2512.00499 entropy split, readings 3: the ceil(top_frac * n) highest-entropy tokens, the
    ceiling taken exactly on the fraction as written (ties: earlier position first), then the remaining ranks
    split evenly into num_bins - 1 bins."""
    ranked = sorted(toks, key=lambda t: -float(ent[i, t]))  # stable: ties keep position order
    n = len(ranked)
    top = max(1, math.ceil(Fraction(str(top_frac)) * n))
    bins = {}
    for r, t in enumerate(ranked):
        bins[t] = 0 if (r < top or num_bins == 1) else 1 + (r - top) * (num_bins - 1) // max(n - top, 1)
    return bins


def espo_terms(logp, old, adv, i, toks, *, ent, vocab_size, alpha, top_frac, num_bins, **_):
    """ESPO arXiv 2512.00499: per entropy bin tau, s_tau = exp(mean_{t in tau} log w_t) in the GSPO-token
    form s_t = sg[s_tau] pi/sg[pi], clip eps_tau = alpha * mean_{t in tau} e_t / log|V|; term
    min(s_t A, clip(s_t, 1 - eps_tau, 1 + eps_tau) A); the paper's aggregation is the mean over tokens
    of a bin, then bins of a sequence, then sequences."""
    bins = espo_bins(ent, i, toks, top_frac=top_frac, num_bins=num_bins)
    terms = {}
    for q in set(bins.values()):
        tau = [t for t in toks if bins[t] == q]
        log_s = sum(float((logp[i, t] - old[i, t]).detach()) for t in tau) / len(tau)
        eps = alpha * sum(float(ent[i, t]) for t in tau) / len(tau) / math.log(vocab_size)
        for t in tau:
            s = math.exp(log_s) * torch.exp(logp[i, t] - logp[i, t].detach())
            terms[t] = torch.minimum(s * adv[i], torch.clamp(s, 1 - eps, 1 + eps) * adv[i])
    return terms


TERMS = {"grpo": grpo_terms, "drgrpo": drgrpo_terms, "gspo": gspo_terms, "gspo-token": gspo_token_terms,
         "gmpo": gmpo_terms, "cispo": cispo_terms, "espo": espo_terms, "reinforce": reinforce_terms}


def reference_loss(loss_type, logp, old, adv, mask, *, aggregation, eps_low=0.2, eps_high=0.28, max_tokens=None,
                   ent=None, vocab_size=None, alpha=0.02, top_frac=0.2, num_bins=2, ref=None, kl_coef=0.0,
                   kl_estimator="k3", infer=None, tis_cap=None, icepop=None):
    """Minus the aggregated objective, by loops. Token value = c_t * term_t - kl_coef * k_t, where
    c_t = min(k, C) (TIS, Yao et al. 2025) or k 1[a <= k <= b] (IcePop, arXiv 2510.18855 sec. 4),
    k = pi_old / pi_infer, and k_t = log pi/pi_ref (k1) or pi_ref/pi - log(pi_ref/pi) - 1 (k3,
    arXiv 2402.03300 eq. 4)."""
    B = logp.shape[0]
    per_seq, total, n_total = [], 0.0, 0
    for i in range(B):
        toks = [t for t in range(logp.shape[1]) if mask[i, t] > 0]
        terms = TERMS[loss_type](logp, old, adv, i, toks, eps_low=eps_low, eps_high=eps_high, ent=ent,
                                 vocab_size=vocab_size, alpha=alpha, top_frac=top_frac, num_bins=num_bins)
        values = {}
        for t in toks:
            v = terms[t]
            if infer is not None:
                k = math.exp(float(old[i, t] - infer[i, t]))
                v = v * (min(k, tis_cap) if tis_cap is not None else (k if icepop[0] <= k <= icepop[1] else 0.0))
            if kl_coef:
                d = ref[i, t] - logp[i, t]  # log pi_ref / pi_theta
                v = v - kl_coef * (-d if kl_estimator == "k1" else torch.exp(d) - d - 1)
            values[t] = v
        seq_sum = sum(values.values()) if toks else torch.zeros((), dtype=logp.dtype)
        total, n_total = total + seq_sum, n_total + len(toks)
        if aggregation == "seq-mean-token-mean":
            per_seq.append(seq_sum / len(toks) if toks else seq_sum)
        elif aggregation == "seq-mean-token-sum":
            per_seq.append(seq_sum)
        elif aggregation == "seq-mean-token-sum-norm":
            per_seq.append(seq_sum / max_tokens)
        elif aggregation == "seq-mean-bin-mean-token-mean":
            bins = espo_bins(ent, i, toks, top_frac=top_frac, num_bins=num_bins)
            means = [sum(values[t] for t in toks if bins[t] == q) / sum(bins[t] == q for t in toks)
                     for q in sorted(set(bins.values()))]
            per_seq.append(sum(means) / len(means) if means else seq_sum)
    if aggregation == "token-mean":
        return -total / n_total
    return -sum(per_seq) / B
