"""A group whose rewards tie has no learning signal: every rule's advantages are exactly 0 and its loss has exactly
zero gradient, for any tied value (issue 13, item 2). Untied groups keep their formulas bit for bit.

Rounding is what this guards against: ``(0.7 + 0.7 + 0.7) / 3 != 0.7`` in float32, so ``r - mean`` used to come
out ~6e-8, VCPO's softmax-weighted baseline was ~1e-7 off even for rewards of 1, and CISPO's division by the
(spurious) std turned 0.7-ties into advantages of +-1.
"""

from __future__ import annotations

import pytest
import torch

import lit_gmc.rules
from lit_gmc import objectives as O
from lit_gmc.corrections import PolicyTerms
from lit_gmc.objectives import MIN_REWARD_STD, group_normalized_advantages, vcpo_baseline

GROUP_SIZES = (2, 3, 5, 8)
DTYPES = (torch.float32, torch.float64)
HAND_PICKED = (0.7, 1 / 3, 0.0, 1.0, -0.7, 1e6, 1e6 + 0.1, -1e6 / 3, 0.1, 2.5e-8)
LENGTH = 5


def tied_values(seed: int) -> list[float]:
    """The hand-picked values plus random ones over many scales and both signs."""
    gen = torch.Generator().manual_seed(seed)
    scales = 10.0 ** torch.randint(-6, 7, (12,), generator=gen).double()
    return [*HAND_PICKED, *(torch.randn(12, generator=gen, dtype=torch.float64) * scales).tolist()]


def tied_batch(values: list[float], group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """One group per value, every reward of a group equal to its value. ``(len(values) * G,)``."""
    return torch.tensor(values, dtype=dtype).repeat_interleave(group_size)


def policy_terms(rewards: torch.Tensor, group_size: int, seed: int) -> PolicyTerms:
    """Random ragged responses whose current log-probs differ from the behaviour ones (ratios away from 1)."""
    gen = torch.Generator().manual_seed(seed)
    n, dtype = rewards.numel(), rewards.dtype
    lengths = torch.randint(1, LENGTH + 1, (n,), generator=gen)
    mask = torch.arange(LENGTH)[None, :] < lengths[:, None]  # (n, L)
    behavior = -torch.rand(n, LENGTH, generator=gen, dtype=dtype) * 3  # (n, L)
    current = (behavior + 0.5 * torch.randn(n, LENGTH, generator=gen, dtype=dtype)).requires_grad_()  # (n, L)
    delays = torch.randint(0, 6, (n // group_size,), generator=gen).repeat_interleave(group_size)  # (n,)
    norms = torch.rand(n, generator=gen, dtype=dtype) + 0.1  # (n,)
    return PolicyTerms(current, behavior, mask, rewards, delays, group_size, grad_norms_sq=norms)


# --- the advantage and baseline functions ---------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("g", GROUP_SIZES)
def test_tied_groups_get_exact_zero_advantages_and_baseline(g, dtype):
    for seed in range(3):
        rewards = tied_batch(tied_values(seed), g, dtype)
        r = rewards.view(-1, g)
        for adv in (
            O.leave_one_out_advantages(rewards, g),
            O.group_centered_advantages(rewards, g),
            group_normalized_advantages(rewards, r.mean(-1), g),  # CISPO's
        ):
            assert adv.dtype == dtype and (adv == 0).all(), adv[adv != 0]
        log_w = torch.randn(rewards.numel(), dtype=dtype)
        norms = torch.rand(rewards.numel(), dtype=dtype) + 0.1
        b = vcpo_baseline(log_w, norms, rewards, g)
        assert torch.equal(b, r[:, 0]), (b - r[:, 0])[b != r[:, 0]]
        assert (group_normalized_advantages(rewards, b, g) == 0).all()


def test_old_formulas_were_off_on_these_ties():
    """The cases the checks exist for: the plain formulas really do round away from zero here."""
    r = torch.full((1, 3), 0.7)
    assert (r - (r.sum(-1, keepdim=True) - r) / 2).abs().max() > 0  # leave-one-out, G = 3
    r = torch.full((1, 8), 0.7)
    assert (r - r.mean(-1, keepdim=True)).abs().max() > 0  # group-centred, G = 8
    assert r.std(-1, unbiased=False) > MIN_REWARD_STD  # so CISPO divided rounding noise by rounding noise


@pytest.mark.parametrize("g", GROUP_SIZES)
def test_untied_groups_keep_their_formulas_bit_for_bit(g):
    """In a batch mixing tied and untied groups, untied rows equal the equations written out, with torch.equal."""
    gen = torch.Generator().manual_seed(g)
    untied = torch.rand(4, g, generator=gen)
    untied[:, 0] = untied[:, 1] + 0.25  # at least two distinct rewards per group
    untied[1] = torch.tensor([0.0, 1.0] * (g // 2) + [1.0] * (g % 2))  # a 0/1 group
    tied = torch.full((2, g), 0.7)
    r = torch.cat([untied[:2], tied[:1], untied[2:], tied[1:]])  # (6, G)
    is_tied = torch.tensor([False, False, True, False, False, True])
    rewards = r.reshape(-1)

    loo = r - (r.sum(-1, keepdim=True) - r) / (g - 1)
    centred = r - r.mean(-1, keepdim=True)
    std = r.std(-1, unbiased=False, keepdim=True)
    normalized = (r - r.mean(-1, keepdim=True)) / std
    log_w, norms = torch.randn(6 * g, generator=gen), torch.rand(6 * g, generator=gen) + 0.1
    weights = torch.softmax(2 * log_w.view(-1, g) + norms.view(-1, g).log(), -1)
    b_star = (weights * r).sum(-1)
    for got, want in (
        (O.leave_one_out_advantages(rewards, g), loo),
        (O.group_centered_advantages(rewards, g), centred),
        (group_normalized_advantages(rewards, r.mean(-1), g), normalized),
        (vcpo_baseline(log_w, norms, rewards, g), b_star),
    ):
        got = got.view(want.shape[0], -1)
        assert torch.equal(got[~is_tied], want[~is_tied].view(got[~is_tied].shape))
        expected_tied = r[is_tied, :1] if got.shape[1] == 1 else torch.zeros_like(got[is_tied])
        assert torch.equal(got[is_tied], expected_tied)


def test_near_ties_are_not_ties():
    """Rewards one ulp apart are untied: each rule keeps its formula (normalised: the two rows are +-1)."""
    a = torch.tensor(0.7)
    r = torch.stack([a, torch.nextafter(a, torch.tensor(1.0))])  # (2,)
    adv = O.leave_one_out_advantages(r, 2)
    assert torch.equal(adv, r - (r.sum() - r) / 1)  # as rounded by the formula, not forced to 0
    assert (adv != 0).any()
    mean = r.mean(-1, keepdim=True)
    assert torch.equal(group_normalized_advantages(r, mean, 2), (r - mean) / r.std(unbiased=False))


def test_nan_rewards_are_never_ties():
    """NaN != NaN: a group of NaN rewards is not silently zeroed (non-finite rewards are rejected upstream)."""
    adv = O.group_centered_advantages(torch.full((3,), float("nan")), 3)
    assert adv.isnan().all()


# --- every rule of the registry -----------------------------------------------------------------


RULES = {name: rule() for name, rule in lit_gmc.rules.registered().items()}  # the built-in rules
RULES["A3PO_capped"] = lit_gmc.rules.A3PO(behavior_cap=5.0)  # AReaL's masking of pi_prox / pi_b > 5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("g", GROUP_SIZES)
@pytest.mark.parametrize("name", sorted(RULES))
def test_every_rule_gives_zero_advantages_and_zero_gradient_on_an_all_tied_batch(name, g, dtype):
    entry = RULES[name]
    for seed in range(2):
        rewards = tied_batch(tied_values(seed), g, dtype)
        terms = policy_terms(rewards, g, seed)
        out = entry(terms)
        assert (out.advantages == 0).all(), out.advantages[out.advantages != 0]
        loss = O.aggregate_loss(
            out.token_loss, terms.mask, entry.aggregation,
            max_length=LENGTH, total_sequences=rewards.numel(), total_tokens=int(terms.mask.sum()),
        )  # fmt: skip
        (grad,) = torch.autograd.grad(loss, terms.token_logprobs)
        assert (grad == 0).all(), f"{name}: largest gradient {grad.abs().max().item()}"
        assert loss.item() == 0


@pytest.mark.parametrize("name", sorted(RULES))
def test_every_rule_still_learns_from_the_untied_groups_of_a_mixed_batch(name):
    """Zeroing ties does not switch a rule off: untied groups get nonzero advantages and gradient, tied ones none."""
    g, entry = 4, RULES[name]
    rewards = torch.tensor([0.7] * g + [1.0, 0.0, 0.0, 1.0] + [1 / 3] * g)
    terms = policy_terms(rewards, g, seed=0)
    out = entry(terms)
    loss = O.aggregate_loss(out.token_loss, terms.mask, entry.aggregation, max_length=LENGTH,
                            total_sequences=rewards.numel(), total_tokens=int(terms.mask.sum()))  # fmt: skip
    (grad,) = torch.autograd.grad(loss, terms.token_logprobs)
    tied = torch.tensor([True] * g + [False] * g + [True] * g)
    assert (out.advantages[tied] == 0).all() and (out.advantages[~tied] != 0).all()
    assert (grad[tied] == 0).all() and grad[~tied].abs().sum() > 0
