"""Pure math of objectives.py: hand-built rows, properties over seeded random inputs, naive references."""

from __future__ import annotations

import math

import pytest
import torch

import lit_gmc.rules
from lit_gmc import objectives as O
from lit_gmc.corrections import PolicyTerms
from lit_gmc.rules import GMC, GRPO, IS, TIC

SEEDS = range(20)


def naive_leave_one_out(rewards: list[float]) -> list[float]:
    g = len(rewards)
    return [r - sum(rewards[j] for j in range(g) if j != i) / (g - 1) for i, r in enumerate(rewards)]


# --- advantages ---------------------------------------------------------------------------------


def test_leave_one_out_matches_formula_by_hand():
    adv = O.leave_one_out_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 4)
    # r_i - mean of the other three: 1 - 1/3, 0 - 2/3, 0 - 2/3, 1 - 1/3
    torch.testing.assert_close(adv, torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]))


@pytest.mark.parametrize("seed", SEEDS)
def test_leave_one_out_equals_naive_loop_sums_to_zero_and_ignores_shifts(seed):
    gen = torch.Generator().manual_seed(seed)
    g = int(torch.randint(2, 9, (1,), generator=gen))
    rewards = torch.rand(3 * g, generator=gen, dtype=torch.float64)
    adv = O.leave_one_out_advantages(rewards, g)
    expected = [a for b in range(3) for a in naive_leave_one_out(rewards[b * g : (b + 1) * g].tolist())]
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64))
    torch.testing.assert_close(adv.view(3, g).sum(-1), torch.zeros(3, dtype=torch.float64))
    torch.testing.assert_close(O.leave_one_out_advantages(rewards + 3.5, g), adv)


def test_group_centered_is_reward_minus_mean():
    torch.testing.assert_close(O.group_centered_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4),
                               torch.tensor([0.75, -0.25, -0.25, -0.25]))  # fmt: skip


def test_leave_one_out_rejects_singleton_groups_and_ragged_rows():
    with pytest.raises(ValueError, match="G >= 2"):
        O.leave_one_out_advantages(torch.ones(3), 1)
    with pytest.raises(ValueError, match="G=4"):
        O.leave_one_out_advantages(torch.ones(6), 4)


# --- tied rewards -------------------------------------------------------------------------------
# A group whose rewards tie has no learning signal: every advantage function and every rule gives exactly 0, and a
# zero gradient, for any tied value (issue 13, item 2); untied groups keep their formulas bit for bit. Rounding is
# what this guards against: (0.7 + 0.7 + 0.7) / 3 != 0.7 in float32, so r - mean came out ~6e-8, VCPO's
# softmax-weighted baseline was ~1e-7 off even for rewards of 1, and CISPO's division by the (spurious) std turned
# 0.7-ties into advantages of +-1.


def test_tied_groups_by_hand():
    grouped = torch.tensor([[0.7, 0.7, 0.7], [0.7, 0.7, 0.70001], [float("nan")] * 3, [-2.0, -2.0, -2.0]])
    assert O.tied_groups(grouped).tolist() == [[True], [False], [False], [True]]


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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("g", GROUP_SIZES)
def test_tied_groups_get_exact_zero_advantages_and_baseline(g, dtype):
    for seed in range(3):
        rewards = tied_batch(tied_values(seed), g, dtype)
        r = rewards.view(-1, g)
        for adv in (
            O.leave_one_out_advantages(rewards, g),
            O.group_centered_advantages(rewards, g),
            O.group_normalized_advantages(rewards, r.mean(-1), g),  # CISPO's
        ):
            assert adv.dtype == dtype and (adv == 0).all(), adv[adv != 0]
        log_w = torch.randn(rewards.numel(), dtype=dtype)
        norms = torch.rand(rewards.numel(), dtype=dtype) + 0.1
        b = O.vcpo_baseline(log_w, norms, rewards, g)
        assert torch.equal(b, r[:, 0]), (b - r[:, 0])[b != r[:, 0]]
        assert (O.group_normalized_advantages(rewards, b, g) == 0).all()


def test_old_formulas_were_off_on_these_ties():
    """The cases the checks exist for: the plain formulas really do round away from zero here."""
    r = torch.full((1, 3), 0.7)
    assert (r - (r.sum(-1, keepdim=True) - r) / 2).abs().max() > 0  # leave-one-out, G = 3
    r = torch.full((1, 8), 0.7)
    assert (r - r.mean(-1, keepdim=True)).abs().max() > 0  # group-centred, G = 8
    assert r.std(-1, unbiased=False) > O.MIN_REWARD_STD  # so CISPO divided rounding noise by rounding noise


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
        (O.group_normalized_advantages(rewards, r.mean(-1), g), normalized),
        (O.vcpo_baseline(log_w, norms, rewards, g), b_star),
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
    assert torch.equal(O.group_normalized_advantages(r, mean, 2), (r - mean) / r.std(unbiased=False))


def test_nan_rewards_are_never_ties():
    """NaN != NaN: a group of NaN rewards is not silently zeroed (non-finite rewards are rejected upstream)."""
    adv = O.group_centered_advantages(torch.full((3,), float("nan")), 3)
    assert adv.isnan().all()


RULES = {name: rule() for name, rule in lit_gmc.rules.registered().items()}  # the built-in rules
RULES["A3PO_capped"] = lit_gmc.rules.A3PO(behavior_cap=5.0)  # AReaL's masking of pi_prox / pi_b > 5
# verl's band [0.999, 1.001] rejects every response of policy_terms (log-ratios of size 0.5 a token): a wider one
RULES["GeoMIS"] = lit_gmc.rules.GeoMIS(low=0.5, high=2.0)


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


# --- GMC ----------------------------------------------------------------------------------------


def naive_gmc(log_rho: list[float], eps: float) -> list[float]:
    rho = [math.exp(x) for x in log_rho]
    factor = max(1.0, (sum(rho) / len(rho)) / (1 + eps))
    return [r / factor for r in rho]


def test_gmc_identity_when_group_mean_below_cap():
    log_rho = torch.log(torch.tensor([0.5, 1.0, 1.2, 1.3]))  # mean 1.0 <= 1.28
    torch.testing.assert_close(O.gmc_coefficients(log_rho, 4, 0.28), log_rho.exp())


def test_gmc_rescales_whole_group_by_one_factor():
    rho = torch.tensor([0.5, 1.0, 3.0, 4.5])  # mean 2.25 > 1.28
    coef = O.gmc_coefficients(rho.log(), 4, 0.28)
    torch.testing.assert_close(coef, rho * (1.28 / 2.25))
    torch.testing.assert_close(coef.mean(), torch.tensor(1.28))


@pytest.mark.parametrize("seed", SEEDS)
def test_gmc_group_mean_is_min_of_mean_ratio_and_cap_and_matches_naive(seed):
    gen = torch.Generator().manual_seed(seed)
    g, eps = 8, float(torch.rand(1, generator=gen)) * 0.5 + 0.01
    log_rho = torch.randn(5 * g, generator=gen, dtype=torch.float64) * 1.5
    coef = O.gmc_coefficients(log_rho, g, eps)
    rho_bar = log_rho.exp().view(5, g).mean(-1)
    torch.testing.assert_close(coef.view(5, g).mean(-1), torch.clamp(rho_bar, max=1 + eps))
    expected = [c for b in range(5) for c in naive_gmc(log_rho[b * g : (b + 1) * g].tolist(), eps)]
    torch.testing.assert_close(coef, torch.tensor(expected, dtype=torch.float64))


def test_gmc_is_finite_for_extreme_log_ratios():
    log_rho = torch.tensor([1e4, -1e4, 0.0, 5.0, -1e4, -1e4, -1e4, -1e4])
    coef = O.gmc_coefficients(log_rho, 4, 0.28)
    assert torch.isfinite(coef).all()
    # group 0: the 1e4 trajectory carries all the capped mass, G * (1 + eps)
    torch.testing.assert_close(coef[:4], torch.tensor([4 * 1.28, 0.0, 0.0, 0.0]))
    # group 1: every ratio is e^-1e4, far below the cap: left alone, i.e. 0 in float precision, not NaN
    assert (coef[4:] == 0).all()
    assert torch.isfinite(O.group_ess(log_rho, 4)).all()
    assert torch.isfinite(O.removed_mass(log_rho, coef, 4)).all()


def test_gmc_group_factor_gets_no_gradient():
    """The surrogate's gradient w.r.t. each token log-prob is -rho_hat_i * A_i / (T N): no term from the factor."""
    g, length = 4, 3
    behavior = torch.zeros(g, length, dtype=torch.float64)
    current = torch.tensor([[0.5, 0.2, 0.1], [0.0, 0.0, 0.0], [-0.3, 0.0, 0.9], [1.0, 0.4, 0.2]],
                           dtype=torch.float64, requires_grad=True)  # fmt: skip
    mask = torch.ones(g, length, dtype=torch.bool)
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    terms = PolicyTerms(current, behavior, mask, rewards, torch.zeros(g, dtype=torch.long), g)
    out = GMC(cap=0.28)(terms)
    assert not out.coefficients.requires_grad
    loss = O.aggregate_loss(out.token_loss, mask, "seq_sum_over_T", max_length=5, total_sequences=g, total_tokens=12)
    (grad,) = torch.autograd.grad(loss, current)
    rho_hat = torch.tensor(naive_gmc(current.detach().sum(-1).tolist(), 0.28), dtype=torch.float64)
    adv = torch.tensor(naive_leave_one_out(rewards.tolist()), dtype=torch.float64)
    torch.testing.assert_close(grad, (-(rho_hat * adv) / (5 * g))[:, None].expand(g, length))


# --- TIC, IS and the estimator class (eq. 5) ------------------------------------------------------


def test_tic_drops_exactly_the_trajectories_above_the_cap():
    rho = torch.tensor([0.5, 1.28, 1.2801, 7.0])
    coef = O.tic_coefficients(rho.log(), 0.28)
    torch.testing.assert_close(coef, torch.tensor([0.5, 1.28, 0.0, 0.0]))


def test_tic_keeps_a_trajectory_exactly_at_the_cap():
    """Eq. 35's indicator is ``rho <= 1 + eps``: a ratio equal to the cap is kept (float64, no rounding in between)."""
    at_cap = torch.tensor([math.log1p(0.28)], dtype=torch.float64)
    assert O.tic_coefficients(at_cap, 0.28).item() == pytest.approx(1.28, rel=1e-15)


def test_tic_does_not_look_at_the_advantage_sign():
    """Remark 1: the indicator depends on rho only (unlike PPO's asymmetric clip)."""
    g = 4
    current = torch.tensor([[2.0], [0.0], [0.0], [0.0]], dtype=torch.float64)
    for rewards in ([1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 1.0, 1.0]):
        terms = PolicyTerms(current, torch.zeros_like(current), torch.ones(g, 1, dtype=torch.bool),
                            torch.tensor(rewards, dtype=torch.float64), torch.zeros(g, dtype=torch.long),
                            g)  # fmt: skip
        assert TIC(cap=0.28)(terms).coefficients[0] == 0


@pytest.mark.parametrize("rule", ["gmc", "tic"])
@pytest.mark.parametrize("seed", SEEDS)
def test_class_constraints_of_eq5(rule, seed):
    """0 <= w_i <= 1 and (1/G) sum_i w_i rho_i <= 1 + eps for every group."""
    gen = torch.Generator().manual_seed(seed)
    g, eps = 8, 0.28
    log_rho = torch.randn(6 * g, generator=gen, dtype=torch.float64) * 2
    coef = O.gmc_coefficients(log_rho, g, eps) if rule == "gmc" else O.tic_coefficients(log_rho, eps)
    w = coef / log_rho.exp()
    assert (w >= 0).all() and (w <= 1 + 1e-12).all()
    assert (coef.view(6, g).mean(-1) <= 1 + eps + 1e-12).all()


def test_ratio_is_one_when_policies_match():
    gen = torch.Generator().manual_seed(0)
    lp = -torch.rand(6, 5, generator=gen)
    mask = torch.rand(6, 5, generator=gen) > 0.3
    assert (O.log_ratio(lp, lp, mask) == 0).all()
    torch.testing.assert_close(O.gmc_coefficients(torch.zeros(6), 3, 0.2), torch.ones(6))
    torch.testing.assert_close(O.is_coefficients(torch.zeros(6)), torch.ones(6))


def test_is_coefficients_are_the_plain_ratio():
    log_rho = torch.tensor([0.0, 1.0, -2.0])
    torch.testing.assert_close(O.is_coefficients(log_rho), log_rho.exp())


# --- PPO clip (vanilla GRPO) --------------------------------------------------------------------


def test_ppo_clip_rows_by_hand():
    ratio = torch.tensor([[0.5, 1.0, 1.5, 1.5]])
    lp = ratio.log()
    mask = torch.ones(1, 4, dtype=torch.bool)
    pos = O.ppo_clip_token_loss(lp, torch.zeros(1, 4), mask, torch.tensor([1.0]), 0.2)
    neg = O.ppo_clip_token_loss(lp, torch.zeros(1, 4), mask, torch.tensor([-1.0]), 0.2)
    # A > 0: min(r, clip(r)) -> 0.5, 1.0, 1.2, 1.2 ; A < 0: min(-r, -clip(r)) -> -0.8, -1.0, -1.5, -1.5
    torch.testing.assert_close(pos, -torch.tensor([[0.5, 1.0, 1.2, 1.2]]))
    torch.testing.assert_close(neg, torch.tensor([[0.8, 1.0, 1.5, 1.5]]))


def test_ppo_clip_gradient_vanishes_on_the_clipped_side():
    lp = torch.log(torch.tensor([[0.5, 1.5]])).requires_grad_()
    loss = O.ppo_clip_token_loss(lp, torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool), torch.tensor([1.0]), 0.2)
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    # r = 0.5 unclipped: d(-r A)/d log r = -r = -0.5 ; r = 1.5 clipped above for A > 0: no gradient
    torch.testing.assert_close(grad, torch.tensor([[-0.5, 0.0]]))


# --- aggregation and padding ----------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["seq_sum_over_T", "token_mean", "seq_mean_token_mean"])
def test_micro_batch_shares_add_up_to_the_full_loss(mode):
    gen = torch.Generator().manual_seed(1)
    loss = torch.randn(8, 6, generator=gen, dtype=torch.float64)
    mask = torch.rand(8, 6, generator=gen) > 0.3
    mask[:, 0] = True
    loss = loss.masked_fill(~mask, 0.0)
    kw = {"max_length": 6, "total_sequences": 8, "total_tokens": int(mask.sum())}
    full = O.aggregate_loss(loss, mask, mode, **kw)
    parts = O.aggregate_loss(loss[:3], mask[:3], mode, **kw) + O.aggregate_loss(loss[3:], mask[3:], mode, **kw)
    torch.testing.assert_close(parts, full)
    lengths = mask.sum(-1)
    expected = {
        "seq_sum_over_T": loss.sum() / (6 * 8),
        "token_mean": loss.sum() / mask.sum(),
        "seq_mean_token_mean": (loss.sum(-1) / lengths).mean(),
    }[mode]
    torch.testing.assert_close(full, expected)


def test_unknown_aggregation_is_named():
    with pytest.raises(ValueError, match="'sum'"):
        O.aggregate_loss(torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool), "sum", max_length=1,
                         total_sequences=1, total_tokens=1)  # fmt: skip


@pytest.mark.parametrize("rule", ["gmc", "tic", "is", "grpo"])
def test_padding_never_changes_the_loss_or_gets_gradient(rule):
    gen = torch.Generator().manual_seed(2)
    g = 4
    current = (-torch.rand(g, 5, generator=gen, dtype=torch.float64)).requires_grad_()
    behavior = -torch.rand(g, 5, generator=gen, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]], dtype=torch.bool)
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=torch.float64)

    def loss_of(cur, beh):
        terms = PolicyTerms(cur, beh, mask, rewards, torch.zeros(g, dtype=torch.long), g)
        correction = {"gmc": GMC(cap=0.28), "tic": TIC(cap=0.28), "is": IS(), "grpo": GRPO(clip=0.28)}[rule]
        out = correction(terms)
        return O.aggregate_loss(out.token_loss, mask, correction.aggregation, max_length=5,
                                total_sequences=g, total_tokens=int(mask.sum()))  # fmt: skip

    base = loss_of(current, behavior)
    (grad,) = torch.autograd.grad(base, current)
    assert (grad[~mask] == 0).all()
    junk = torch.where(mask, 0.0, 123.0).double()
    torch.testing.assert_close(loss_of(current + junk, behavior - junk), base)


def test_shape_errors_print_shapes():
    with pytest.raises(ValueError, match=r"\(3, 4\)"):
        O.sequence_logprob(torch.zeros(3, 4), torch.ones(3, 5, dtype=torch.bool))


# --- diagnostics ----------------------------------------------------------------------------------


def test_ess_and_removed_mass_by_hand():
    log_rho = torch.tensor([1.0, 1.0, 1.0, 1.0, 4.0, 1.0, 1.0, 1.0]).log()
    torch.testing.assert_close(O.group_ess(log_rho, 4), torch.tensor([4.0, 49 / 19]))
    coef = O.tic_coefficients(log_rho, 0.28)  # drops the 4.0
    torch.testing.assert_close(O.removed_mass(log_rho, coef, 4), torch.tensor([0.0, 1.0], dtype=torch.float64))


def test_entropy_matches_definition():
    logits = torch.tensor([[0.0, 0.0], [10.0, -10.0]], dtype=torch.float64)
    p = torch.softmax(logits, -1)
    torch.testing.assert_close(O.token_entropy(torch.log_softmax(logits, -1)), -(p * p.log()).sum(-1))


@pytest.mark.parametrize("seed", range(5))
def test_entropy_in_float32_against_float64_definition(seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 5, 1000, generator=gen, dtype=torch.float64) * (1 + 4 * seed)  # from flat to peaked
    p = torch.softmax(logits, -1)
    want = -(p * p.log()).sum(-1)  # (3, 5)
    got = O.token_entropy(torch.log_softmax(logits.float(), -1))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)
    assert (got >= -1e-6).all() and (got <= math.log(1000) + 1e-4).all()  # 0 <= H <= log V


def test_entropy_of_uniform_and_one_hot_rows():
    uniform = torch.full((1, 64), -math.log(64), dtype=torch.float64)
    torch.testing.assert_close(O.token_entropy(uniform), torch.tensor([math.log(64)], dtype=torch.float64))
    peaked = torch.log_softmax(torch.tensor([[0.0, -200.0, -200.0]], dtype=torch.float64), -1)
    assert float(O.token_entropy(peaked)) < 1e-80


def test_mismatch_statistics_match_their_definitions_and_estimate_kl_and_chi2_from_samples():
    gen = torch.Generator().manual_seed(0)
    b = torch.softmax(torch.randn(7, generator=gen, dtype=torch.float64), 0)  # behaviour
    p = torch.softmax(torch.randn(7, generator=gen, dtype=torch.float64), 0)  # current
    tokens = torch.multinomial(b, 200_000, replacement=True, generator=gen)
    log_r = torch.log(p / b)[tokens]
    stats = O.mismatch_statistics(log_r, log_r[:1000])
    kl, chi2 = float((b * torch.log(b / p)).sum()), float((p**2 / b).sum() - 1)  # KL(b || p), chi^2(p || b)
    assert float(stats["k1"]) == pytest.approx(kl, rel=0.02)
    assert float(stats["k3"]) == pytest.approx(kl, rel=0.02)
    assert float(stats["chi2_token"]) == pytest.approx(chi2, rel=0.05)
    r = log_r[:1000].exp()
    assert float(stats["chi2_seq"]) == pytest.approx(float((r**2).mean() - 1), rel=1e-12)
    zero = O.mismatch_statistics(torch.zeros(5), torch.zeros(3))  # on-policy: every divergence is 0
    assert all(float(v) == 0.0 for v in zero.values())
    huge = O.mismatch_statistics(torch.tensor([1e4, -1e4]), torch.tensor([1e4]))  # clamped at +-20: finite
    assert all(math.isfinite(float(v)) for v in huge.values())
