"""Pure math of objectives.py: hand-built rows, properties over seeded random inputs, naive references."""

from __future__ import annotations

import math

import pytest
import torch

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


@pytest.mark.parametrize("fn", [O.leave_one_out_advantages, O.group_centered_advantages])
def test_zero_variance_groups_give_exact_zero_advantage(fn):
    rewards = torch.tensor([1.0] * 4 + [0.0] * 4 + [1.0, 0.0, 1.0, 0.0])
    adv = fn(rewards, 4)
    assert torch.isfinite(adv).all()
    assert (adv[:8] == 0).all()
    assert (adv[8:] != 0).all()


def test_tied_groups_by_hand():
    grouped = torch.tensor([[0.7, 0.7, 0.7], [0.7, 0.7, 0.70001], [float("nan")] * 3, [-2.0, -2.0, -2.0]])
    assert O.tied_groups(grouped).tolist() == [[True], [False], [False], [True]]


def test_group_centered_is_reward_minus_mean():
    torch.testing.assert_close(O.group_centered_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4),
                               torch.tensor([0.75, -0.25, -0.25, -0.25]))  # fmt: skip


def test_leave_one_out_rejects_singleton_groups_and_ragged_rows():
    with pytest.raises(ValueError, match="G >= 2"):
        O.leave_one_out_advantages(torch.ones(3), 1)
    with pytest.raises(ValueError, match="G=4"):
        O.leave_one_out_advantages(torch.ones(6), 4)


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
