"""The corrections the large async stacks ship (GSPO, IcePop, M2PO, DPPO, sequence-level TIS/MIS on the ratio and on
its geometric mean): each rule's gradient against its published formula, against the peers' own formulas on the same
batch, and at its edges.

Three sides meet here:
- the learner's production path (left-padded batch, chunked log-probs, the registered rule and its aggregation);
- the published formula, written out per token as the coefficient ``k_it`` of ``grad log pi(y_it)`` in the loss's
  gradient, on one plain full-logits forward per unpadded sequence in float64 (tests/test_baselines.py's helpers);
- each peer's formula as it writes it (verl's GSPO-token, TRL's sequence GSPO, verl's decoupled IcePop weight on a
  PPO loss, prime-rl's DPPO loss, AReaL's M2PO suffix-mean mask, verl's rollout-correction weights), differentiated
  by autograd on the same log-probs. Facts from their sources, our own code.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_baselines import T_MAX, direct_logprobs, flat_grad, load_module, make_batch, terms_for

from lit_gmc import objectives as O
from lit_gmc.corrections import PolicyTerms
from lit_gmc.rules import DPPO, GSPO, M2PO, GeoMIS, GeoTIS, IcePop, SeqMIS, SeqTIS

G = 3
PEER_RULES = {
    "gspo": GSPO,
    "gspo_wide": lambda: GSPO(eps_low=0.2, eps_high=0.3),  # a band the batch's sequences fall on both sides of
    "icepop": IcePop,
    "m2po": M2PO,
    "dppo": lambda: DPPO(eps_low=0.005, eps_high=0.005),  # the random model's probabilities are ~1/46: 0.2 never binds
    "seq_tis": SeqTIS,
    "seq_mis": SeqMIS,
    "geo_tis": lambda: GeoTIS(C=1.5),  # the batch's geometric means reach past 1.5, not past the default 2
    "geo_mis": lambda: GeoMIS(low=0.6, high=1.6),  # verl's band [0.999, 1.001] would reject every sequence here
}


def published_coefficients(name: str, rule, batch, lp: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per-token ``k_it`` with ``grad loss = sum_it k_it grad log pi(y_it)``, from each rule's published formula."""
    n, tokens = batch.rewards.numel(), int(batch.response_mask.sum())
    r = batch.rewards.double().view(-1, G)
    centred = (r - r.mean(-1, keepdim=True)).reshape(-1)
    normalized = ((r - r.mean(-1, keepdim=True)) / r.std(-1, unbiased=False, keepdim=True)).reshape(-1)
    d = [lp[i] - batch.behavior_logprobs[i, : lp[i].numel()].double() for i in range(n)]  # log r_t per token
    if name == "m2po":  # Algorithm 1 as the paper prints it: drop the argmax of (log r)^2 while the mean exceeds tau
        flat = torch.cat(d).square()
        kept = list(range(flat.numel()))
        while kept and sum(float(flat[j]) for j in kept) / len(kept) > rule.m2_threshold:
            kept.remove(max(kept, key=lambda j: float(flat[j])))
        keep = torch.zeros(flat.numel(), dtype=torch.bool)
        keep[kept] = True
        keeps = list(torch.split(keep, [x.numel() for x in d]))
    k = []
    for i in range(n):
        ratio = torch.exp(d[i])
        if name.startswith("gspo"):  # J = (1/G) sum_i min(s_i A_i, clip(s_i) A_i), s_i = exp(mean_t log r_t)
            s, a = float(torch.exp(d[i].mean())), float(normalized[i])
            clipped = s > 1 + rule.eps_high if a > 0 else s < 1 - rule.eps_low
            k.append(torch.full_like(d[i], 0.0 if clipped else -a * s / (n * d[i].numel())))
        elif name == "icepop":  # weight k_t on tokens with low <= k_t <= high
            k.append(-ratio * ((ratio >= rule.low) & (ratio <= rule.high)) * centred[i] / tokens)
        elif name == "m2po":  # J = (1/sum |o|) sum M_t r_t A
            k.append(-ratio * keeps[i] * centred[i] / tokens)
        elif name == "dppo":  # prime-rl: -keep A r, keep by the probability moved in the advantage's direction
            moved = torch.exp(lp[i]) - torch.exp(batch.behavior_logprobs[i, : lp[i].numel()].double())
            dropped = moved > rule.eps_high if centred[i] > 0 else moved < -rule.eps_low
            k.append(-ratio * (~dropped) * centred[i] / tokens)
        else:
            rho, g = float(torch.exp(d[i].sum())), float(torch.exp(d[i].mean()))
            if name.endswith("tis"):
                weight = min(g if name == "geo_tis" else rho, rule.C)
            elif name == "seq_mis":
                weight = rho if rule.low <= rho <= rule.high else 0.0
            else:
                weight = 1.0 if rule.low <= g <= rule.high else 0.0
            k.append(torch.full_like(d[i], -weight * float(centred[i]) / tokens))
    return k


@pytest.mark.parametrize("name", list(PEER_RULES))
def test_rule_gradient_equals_its_published_formula(name, float64_actor_dir, char_tokenizer, float64_rmsnorm):
    model = load_module(float64_actor_dir, "gmc").actor
    batch = make_batch(model, char_tokenizer)
    rule = PEER_RULES[name]()
    out = rule(terms_for(model, batch, torch.tensor([0] * G + [5] * G)))
    n, tokens = batch.rewards.numel(), int(batch.response_mask.sum())
    loss = O.aggregate_loss(
        out.token_loss, batch.response_mask, rule.aggregation, max_length=T_MAX, total_sequences=n, total_tokens=tokens
    )
    learner = flat_grad(loss, model)

    lp = [direct_logprobs(model, batch, i) for i in range(n)]
    k = published_coefficients(name, rule, batch, [x.detach() for x in lp])
    reference = flat_grad(sum((ki.detach() * x).sum() for ki, x in zip(k, lp, strict=True)), model)
    assert reference.norm() > 0
    torch.testing.assert_close(learner, reference, rtol=1e-9, atol=1e-12)


def test_the_batch_exercises_every_rules_mask_and_clip(float64_actor_dir, char_tokenizer):
    """Each rule both keeps and drops (or clips) something on the batch above, so the comparison can tell a rule from
    its unmasked or unclipped form."""
    model = load_module(float64_actor_dir, "gmc").actor
    terms = terms_for(model, make_batch(model, char_tokenizer), torch.tensor([0] * G + [5] * G))
    with torch.no_grad():
        shares = {name: PEER_RULES[name]()(terms).extra for name in PEER_RULES}
    fractions = {name: [float(v) for k, v in extra.items() if k.endswith("fraction")] for name, extra in shares.items()
                 if name != "gspo"}  # GSPO's own band (3e-4, 4e-4) holds no sequence; gspo_wide's is crossed both ways
    for name, values in fractions.items():
        assert any(0 < v < 1 for v in values), (name, values)
    assert 0 < shares["m2po"]["m2po/m2_kept"] <= 0.04 < shares["m2po"]["m2po/m2"]


# --- The peers' own formulas, on the same log-probs ---------------------------------------------------------------


def peer_batch(seed: int = 0, n: int = 6, length: int = 5):
    """Hand-made log-probs with gradient, behaviour log-probs, a ragged mask and rewards (two groups of 3)."""
    gen = torch.Generator().manual_seed(seed)
    lp = (-0.2 - torch.rand(n, length, generator=gen, dtype=torch.float64) * 2).requires_grad_()
    behavior = lp.detach() + 0.6 * torch.randn(n, length, generator=gen, dtype=torch.float64)
    behavior = behavior.clamp(max=-1e-3)  # log-probs of real tokens
    mask = torch.ones(n, length, dtype=torch.bool)
    mask[1, 3:] = False
    mask[4, 1:] = False
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    return lp, behavior, mask, rewards


def ours(rule, lp, behavior, mask, rewards) -> torch.Tensor:
    out = rule(PolicyTerms(lp, behavior, mask, rewards, torch.zeros(len(rewards), dtype=torch.long), G))
    n, tokens = mask.shape[0], int(mask.sum())
    loss = O.aggregate_loss(out.token_loss, mask, rule.aggregation, max_length=mask.shape[1], total_sequences=n,
                            total_tokens=tokens)  # fmt: skip
    return torch.autograd.grad(loss, lp)[0]


def masked_token_mean(x, mask):
    return (x * mask).sum() / mask.sum()


def seq_mean_token_mean(x, mask):
    return ((x * mask).sum(-1) / mask.sum(-1)).mean()


def test_gspo_matches_verl_gspo_token_and_trl_sequence_level():
    lp, behavior, mask, rewards = peer_batch()
    rule = GSPO(eps_low=0.2, eps_high=0.3)
    adv = O.group_normalized_advantages(rewards, rewards.view(-1, G).mean(-1), G)[:, None]
    # verl compute_policy_loss_gspo: log s_it = lp - sg(lp) + sg(mean log r), clamp 10, PPO max form,
    # seq-mean-token-mean.
    seq = ((lp.detach() - behavior) * mask).sum(-1) / mask.sum(-1)
    s_t = torch.exp((lp - lp.detach() + seq.detach()[:, None]).clamp(max=10.0))
    verl = seq_mean_token_mean(torch.maximum(-adv * s_t, -adv * s_t.clamp(1 - 0.2, 1 + 0.3)), mask)
    # TRL importance_sampling_level="sequence" with loss_type="grpo": coef = exp(mean log r) with gradient.
    coef = torch.exp(((lp - behavior) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True))
    trl = seq_mean_token_mean(-torch.minimum(coef * adv, coef.clamp(1 - 0.2, 1 + 0.3) * adv).expand_as(lp), mask)
    mine = ours(rule, lp, behavior, mask, rewards)
    for peer in (verl, trl):
        torch.testing.assert_close(mine, torch.autograd.grad(peer, lp)[0], rtol=1e-12, atol=1e-14)
    assert mine.abs().sum() > 0


def test_icepop_matches_verl_decoupled_weight_on_a_ppo_loss_and_the_intellect3_form():
    lp, behavior, mask, rewards = peer_batch(seed=1)
    rule = IcePop(low=0.5, high=2.0)
    adv = O.group_centered_advantages(rewards, G)[:, None]
    # verl decoupled: w = k 1{lo <= k <= hi}, k = pi_old / mu with pi_old the step's recompute (the current policy),
    # multiplying the PPO-clip loss in pi_theta / pi_old (clip 0.2); token-mean.
    k = torch.exp(lp.detach() - behavior)
    w = k * ((k >= 0.5) & (k <= 2.0))
    ratio = torch.exp(lp - lp.detach())
    verl = masked_token_mean(w * torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)), mask)
    # INTELLECT-3 (prime-rl drafts): J = (1/N) sum M(pi_theta / mu) A, the ratio with gradient.
    r = torch.exp(lp - behavior)
    intellect = -masked_token_mean(r * ((r.detach() >= 0.5) & (r.detach() <= 2.0)) * adv, mask)
    mine = ours(rule, lp, behavior, mask, rewards)
    for peer in (verl, intellect):
        torch.testing.assert_close(mine, torch.autograd.grad(peer, lp)[0], rtol=1e-12, atol=1e-14)
    masked = rule(PolicyTerms(lp, behavior, mask, rewards, torch.zeros(6, dtype=torch.long), G)).extra
    assert 0 < float(masked["icepop/masked_fraction"]) < 1


def test_dppo_matches_prime_rl_default_loss_without_its_kl_term():
    lp, behavior, mask, rewards = peer_batch(seed=2)
    adv = O.group_centered_advantages(rewards, G)[:, None]
    # prime-rl default_loss_fn: r = exp(lp - mu) with gradient, keep by the probability difference and sign of A,
    # loss -keep A r summed over tokens / number of loss tokens (masked ones included).
    p, q = torch.exp(lp.detach()), torch.exp(behavior)
    keep = ~torch.where(adv > 0, p - q > 0.2, p - q < -0.2)
    prime = masked_token_mean(-(keep * adv) * torch.exp(lp - behavior), mask)
    mine = ours(DPPO(), lp, behavior, mask, rewards)
    torch.testing.assert_close(mine, torch.autograd.grad(prime, lp)[0], rtol=1e-12, atol=1e-14)
    assert (~keep & mask).any() and (keep & mask & (adv != 0)).any()


def areal_m2po_mask(log_r: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """AReaL's M2PO mask: sort (log r)^2 descending, suffix means, mask the first k where the suffix mean < tau."""
    values = log_r[mask].square()
    order = torch.argsort(values, descending=True)
    ranked = values[order]
    suffix = torch.stack([ranked[k:].mean() for k in range(ranked.numel())])
    k = int((suffix < threshold).nonzero()[0]) if (suffix < threshold).any() else ranked.numel() - 1
    kept = torch.ones_like(values, dtype=torch.bool)
    kept[order[:k]] = False
    out = torch.zeros_like(mask)
    out[mask] = kept
    return out


@pytest.mark.parametrize("seed", range(5))
def test_m2po_mask_matches_arealfs_suffix_means_and_keeps_the_kept_second_moment_under_tau(seed):
    lp, behavior, mask, _ = peer_batch(seed=seed)
    log_r = O.token_log_ratio(lp, behavior, mask)
    mine = O.m2po_keep_mask(log_r, mask, 0.04)
    torch.testing.assert_close(mine, areal_m2po_mask(log_r, mask, 0.04))  # no suffix mean equals tau exactly here
    kept = log_r[mine].square()
    assert kept.numel() > 0 and float(kept.mean()) <= 0.04
    # Greedy is the smallest such mask: putting back the smallest dropped token breaks the budget.
    dropped = log_r[mask & ~mine].square()
    assert float(torch.cat([kept, dropped.min()[None]]).mean()) > 0.04


def test_sequence_rules_match_verl_rollout_correction_weights():
    lp, behavior, mask, rewards = peer_batch(seed=3)
    adv = O.group_centered_advantages(rewards, G)[:, None]
    log_r = (lp.detach() - behavior) * mask
    seq = log_r.sum(-1, keepdim=True).clamp(-20, 20)  # verl: product ratio, log clamped at +-20
    geo = log_r.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True)
    rho, g = torch.exp(seq), torch.exp(geo)
    weights = {  # verl bypass "reinforce": -A w log pi, token-mean
        SeqTIS(C=2.0): rho.clamp(max=2.0),  # rollout_is="sequence", threshold 2.0
        SeqMIS(low=0.5, high=2.0): rho.clamp(max=2.0) * ((-seq >= math.log(0.5)) & (-seq <= math.log(2.0))),  # +RS
        GeoTIS(C=1.1): g.clamp(0.0, 1.1),  # slime tis_level geometric, truncate
        # verl seq_mean_k1 keeps log(lo) <= -mean log r <= log(hi): for a band symmetric in 1/x it is ours.
        GeoMIS(low=0.8, high=1.25): ((-geo >= math.log(0.8)) & (-geo <= math.log(1.25))).double(),
    }
    for rule, w in weights.items():
        peer = masked_token_mean(-(w * adv).detach() * lp, mask)
        changed = rule(PolicyTerms(lp, behavior, mask, rewards, torch.zeros(6, dtype=torch.long), G)).extra
        torch.testing.assert_close(ours(rule, lp, behavior, mask, rewards), torch.autograd.grad(peer, lp)[0],
                                   rtol=1e-12, atol=1e-14)  # fmt: skip
        assert 0 < float(next(iter(changed.values()))) < 1, rule


# --- Edges ---------------------------------------------------------------------------------------------------------

ALL = (GSPO, IcePop, M2PO, DPPO, SeqTIS, SeqMIS, GeoTIS, GeoMIS)


@pytest.mark.parametrize("rule_class", ALL)
def test_huge_ratios_and_empty_responses_stay_finite_and_get_no_gradient_on_padding(rule_class):
    lp, behavior, mask, rewards = peer_batch(seed=4)
    behavior = behavior.clone()
    behavior[0] = -1e4  # a ratio of e^(1e4) per token: exp would overflow in float64 and float32
    mask = mask.clone()
    mask[2] = False  # an empty response
    rule = rule_class()
    for dtype in (torch.float64, torch.float32):
        x = lp.detach().to(dtype).requires_grad_()
        out = rule(PolicyTerms(x, behavior.to(dtype), mask, rewards.to(dtype), torch.zeros(6, dtype=torch.long), G))
        loss = O.aggregate_loss(out.token_loss, mask, rule.aggregation, max_length=5, total_sequences=6,
                                total_tokens=int(mask.sum()))  # fmt: skip
        grad = torch.autograd.grad(loss, x)[0]
        assert torch.isfinite(loss) and torch.isfinite(grad).all(), (rule, dtype)
        assert (grad[~mask] == 0).all()
        assert all(torch.isfinite(v) for v in out.extra.values())


@pytest.mark.parametrize("rule_class", ALL)
def test_tied_rewards_give_no_gradient(rule_class):
    lp, behavior, mask, _ = peer_batch(seed=5)
    rewards = torch.full((6,), 0.7, dtype=torch.float64)
    assert (ours(rule_class(), lp, behavior, mask, rewards) == 0).all()


def test_band_bounds_are_inclusive_and_m2po_ties_drop_in_row_order():
    log_r = torch.log(torch.tensor([0.5, 2.0, 0.4999, 2.0001], dtype=torch.float64))
    weights, kept = O.band_ratio(log_r, 0.5, 2.0)
    assert kept.tolist() == [True, True, False, False]
    torch.testing.assert_close(weights, torch.tensor([0.5, 2.0, 0.0, 0.0], dtype=torch.float64))
    # Four equal (log r)^2 = 0.09 and one 0: means 0.072, 0.0675, 0.06, then 0.045 <= 0.05 once three of the four tied
    # ones are gone, in row order.
    log_r = torch.tensor([[0.3, -0.3, 0.0], [0.3, -0.3, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    keep = O.m2po_keep_mask(log_r, mask, 0.05)
    assert keep.tolist() == [[False, False, True], [False, True, False]]
    assert O.m2po_keep_mask(log_r, mask, 0.09).tolist() == mask.tolist()  # the mean equals tau: nothing dropped
    assert not O.m2po_keep_mask(torch.ones(2, 2), torch.ones(2, 2, dtype=torch.bool), 0.5).any()  # none can stay
    empty = torch.zeros(2, 2, dtype=torch.bool)
    assert not O.m2po_keep_mask(torch.ones(2, 2), empty, 0.5).any()


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: IcePop(low=2.0, high=1.0), "low=2.0 must be < high=1.0"),
        (lambda: SeqMIS(low=0.0), "low=0.0 must be finite and > 0"),
        (lambda: GSPO(eps_low=-1.0), "eps_low=-1.0 must be finite and > 0"),
        (lambda: M2PO(m2_threshold=float("inf")), "m2_threshold=inf must be finite and > 0"),
        (lambda: DPPO(eps_high=0.0, aggregation="sum"), "aggregation='sum' is not one of"),
        (lambda: GeoMIS(high=float("nan")), "high=nan must be finite and > 0"),
    ],
)
def test_bad_options_get_one_message_naming_them(build, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build()
