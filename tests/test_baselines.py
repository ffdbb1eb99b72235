"""VCPO, GAC, A-3PO (unclipped and capped), CISPO, TIS: each rule's gradient against its equation, step rules, fits.

The learner side runs the production path (left-padded batch, chunked log-probs, the registered rule and its
aggregation); the reference side runs one plain full-logits forward per unpadded sequence and forms each
equation by hand in float64.
"""

from __future__ import annotations

import math
from dataclasses import replace
from functools import partial

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import Logger
from run_helpers import tiny_data

import lit_gmc.rules
from lit_gmc import objectives as O
from lit_gmc.batch import RolloutGroup, collate_groups
from lit_gmc.callbacks.weight_sync import WeightSync
from lit_gmc.corrections import PolicyTerms
from lit_gmc.logprobs import response_logprobs
from lit_gmc.module import GMCModule
from lit_gmc.objectives import (
    a3po_alpha,
    a3po_behavior_weight,
    ess_step_factor,
    gac_shift,
    vcpo_baseline,
)
from lit_gmc.rules import A3PO, CISPO, GAC, GMC, TIS, VCPO

BASELINES = ("vcpo", "gac", "a3po", "a3po_capped", "cispo", "tis")
RULES = {"gmc": GMC, "vcpo": VCPO, "gac": GAC, "a3po": A3PO, "a3po_capped": partial(A3PO, behavior_cap=5.0),
         "cispo": CISPO, "tis": TIS}  # fmt: skip
"""Each baseline with its defaults, by test name (``a3po_capped``: A-3PO with AReaL's behaviour cap of 5)."""


T_MAX = 6
G = 3
REWARDS = ([1.0, 0.0, 0.5], [0.2, 0.9, 0.0])
# Per-row shift of the behaviour log-probs below the current ones: row 1 has a large trajectory ratio (VCPO
# truncates it at c = 8) and row 5, in the delay-5 group, tokens with pi_prox / pi_b > 5 (a3po keeps their factor,
# a3po_capped masks them). Both have negative advantages, so PPO's clip does not zero their gradient and the
# truncation/mask is visible.
SHIFTS = (0.0, 3.0, 0.0, 0.0, 0.0, 3.0)


def load_module(actor_dir, correction: str, **kwargs) -> GMCModule:
    return GMCModule(actor=str(actor_dir), correction=RULES[correction](), dtype="float64", max_response_length=T_MAX,
                     **kwargs)  # fmt: skip


def direct_logprobs(model, batch, row: int) -> torch.Tensor:
    """``log pi(y_t | x, y_<t)`` of one row's real response tokens: the row without any padding, full logits."""
    p = batch.prompt_width
    prompt = batch.input_ids[row, :p][batch.attention_mask[row, :p]]
    response = batch.input_ids[row, p:][batch.response_mask[row]]
    logits = model(input_ids=torch.cat([prompt, response])[None]).logits[0]  # (P_i + L_i, V)
    logp = torch.log_softmax(logits.double(), -1)[prompt.numel() - 1 : -1]  # (L_i, V)
    return logp.gather(-1, response[:, None])[:, 0]  # (L_i,)


def flat_grad(scalar, model) -> torch.Tensor:
    grads = torch.autograd.grad(scalar, list(model.parameters()), allow_unused=True)
    pairs = zip(grads, model.parameters(), strict=True)
    return torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1) for g, p in pairs])


def make_batch(model, tokenizer, *, seed: int = 0):
    """2 groups x 3 responses of random tokens with ragged prompts and responses; behaviour log-probs are the
    current ones minus noise and the SHIFTS above."""
    gen = torch.Generator().manual_seed(seed)
    lo, hi = 3, len(tokenizer)
    groups = []
    for b, prompt_len in enumerate((3, 5)):
        lengths = torch.randint(1, T_MAX + 1, (G,), generator=gen)
        lengths[0] = T_MAX  # one full-length response per group
        ids = torch.randint(lo, hi, (G, T_MAX), generator=gen)
        mask = torch.arange(T_MAX)[None, :] < lengths[:, None]
        groups.append(RolloutGroup(
            prompt_id=b, prompt="", answer="", prompt_ids=torch.randint(lo, hi, (prompt_len,), generator=gen),
            response_ids=ids.masked_fill(~mask, tokenizer.pad_token_id), response_mask=mask,
            behavior_logprobs=torch.zeros(G, T_MAX), finish_reasons=["stop"] * G,
            rewards=torch.tensor(REWARDS[b]), version=0,
        ))  # fmt: skip
    batch = collate_groups(groups, pad_id=tokenizer.pad_token_id)
    behavior = torch.zeros(batch.response_mask.shape, dtype=torch.float64)
    with torch.no_grad():
        for i in range(batch.rewards.numel()):
            lp = direct_logprobs(model, batch, i)
            behavior[i, : lp.numel()] = (
                lp - SHIFTS[i] + 0.4 * torch.randn(lp.numel(), generator=gen, dtype=torch.float64)
            )
    return replace(batch, behavior_logprobs=behavior.float())


def terms_for(model, batch, delays, grad_norms_sq=None) -> PolicyTerms:
    logprobs, _ = response_logprobs(model, batch.input_ids, batch.attention_mask, batch.prompt_width)
    return PolicyTerms(
        token_logprobs=logprobs, behavior_logprobs=batch.behavior_logprobs.double(), mask=batch.response_mask,
        rewards=batch.rewards.double(), delays=delays, group_size=batch.group_size, grad_norms_sq=grad_norms_sq,
    )  # fmt: skip


def brute_force_grad_norms_sq(model, batch) -> torch.Tensor:
    """``||grad log pi(y_i)||^2`` by one backward per trajectory into ``.grad``."""
    norms = []
    for i in range(batch.rewards.numel()):
        model.zero_grad(set_to_none=True)
        direct_logprobs(model, batch, i).sum().backward()
        norms.append(sum(float(p.grad.square().sum()) for p in model.parameters() if p.grad is not None))
    model.zero_grad(set_to_none=True)
    return torch.tensor(norms, dtype=torch.float64)


def written_out_coefficients(name, batch, lp, delays, norms):
    """Per-token ``k_it`` with ``grad loss = sum_it k_it grad log pi(y_it)``, each rule derived by hand."""
    n, eps = batch.rewards.numel(), RULES[name]().threshold
    r = batch.rewards.double().view(-1, G)
    d = [lp[i] - batch.behavior_logprobs[i, : lp[i].numel()].double() for i in range(n)]  # log pi - l per token
    tokens = int(batch.response_mask.sum())
    centred = (r - r.mean(-1, keepdim=True)).reshape(-1)
    normalized = ((r - r.mean(-1, keepdim=True)) / r.std(-1, unbiased=False, keepdim=True)).reshape(-1)
    k = []
    for i in range(n):
        if name == "vcpo":
            w = torch.stack([torch.exp(x.sum()) for x in d]).view(-1, G)  # unclipped sequence ratios
            weight = w**2 * norms.view(-1, G)
            b_star = (weight * r).sum(-1) / weight.sum(-1)
            adv = (r - b_star[:, None]) / r.std(-1, unbiased=False, keepdim=True)
            k.append(-min(float(w.view(-1)[i]), eps) * adv.view(-1)[i] / (n * d[i].numel()) * torch.ones_like(d[i]))
        elif name in ("gac", "a3po", "a3po_capped"):
            alpha = 1.0 / max(1, int(delays[i])) if name != "gac" else 1.0
            ratio = torch.exp(alpha * d[i])  # pi_theta / pi_prox, and its derivative is ratio * grad log pi
            behavior_weight = torch.exp((1 - alpha) * d[i])  # pi_prox / pi_b, unclipped in a3po
            if name == "a3po_capped":
                behavior_weight = torch.where(behavior_weight <= 5.0, behavior_weight, torch.zeros_like(ratio))
            adv = centred[i]
            clipped = (ratio > 1 + eps) if adv > 0 else (ratio < 1 - eps)  # the constant branch of the min
            scale = n * d[i].numel() if name == "gac" else tokens
            k.append(-behavior_weight * adv * ratio * (~clipped) / scale)
        elif name == "cispo":
            k.append(-torch.exp(d[i]).clamp(max=1 + eps) * normalized[i] / tokens)
        elif name == "tis":
            k.append(-torch.exp(d[i]).clamp(max=eps) * centred[i] / tokens)
    return k


@pytest.mark.parametrize("name", BASELINES)
def test_rule_gradient_equals_equation_written_out(name, float64_actor_dir, char_tokenizer, float64_rmsnorm):
    model = load_module(float64_actor_dir, "gmc").actor
    batch = make_batch(model, char_tokenizer)
    delays = torch.tensor([0] * G + [5] * G)
    norms = brute_force_grad_norms_sq(model, batch)
    entry = RULES[name]()
    out = entry(terms_for(model, batch, delays, norms if entry.needs_grad_norms else None))
    n, tokens = batch.rewards.numel(), int(batch.response_mask.sum())
    loss = O.aggregate_loss(
        out.token_loss, batch.response_mask, entry.aggregation, max_length=T_MAX, total_sequences=n, total_tokens=tokens
    )
    learner = flat_grad(loss, model)

    lp = [direct_logprobs(model, batch, i) for i in range(batch.rewards.numel())]
    k = written_out_coefficients(name, batch, [x.detach() for x in lp], delays, norms)
    reference = flat_grad(sum((ki.detach() * x).sum() for ki, x in zip(k, lp, strict=True)), model)
    assert reference.norm() > 0
    torch.testing.assert_close(learner, reference, rtol=1e-9, atol=1e-12)


STD_NORMALISED = frozenset({"VCPO", "CISPO", "GSPO"})
"""Rules whose advantage is divided by the group's reward std: a reward's scale does not change their gradient."""


@pytest.mark.parametrize("name", list(lit_gmc.rules.registered()))
def test_every_rule_ignores_a_reward_shift_and_scales_with_the_reward_range(name, float64_actor_dir, char_tokenizer,
                                                                            float64_rmsnorm):  # fmt: skip
    """Why a task's reward need not lie in [0, 1] (``Task.score``): every rule's gradient is the same for rewards
    ``r`` and ``r - 3`` (group advantages are differences), and for ``10 r`` it is 10 times as large, except for the
    rules in :data:`STD_NORMALISED`, for which it is the same."""
    model = load_module(float64_actor_dir, "gmc").actor
    batch = make_batch(model, char_tokenizer)
    delays = torch.tensor([0] * G + [5] * G)
    # verl's Geo-RS band [0.999, 1.001] rejects every response of this batch: a band it passes through
    rule = lit_gmc.rules.GeoMIS(low=0.5, high=2.0) if name == "GeoMIS" else lit_gmc.rules.registered()[name]()
    norms = brute_force_grad_norms_sq(model, batch) if rule.needs_grad_norms else None

    def gradient(rewards: torch.Tensor) -> torch.Tensor:
        out = rule(terms_for(model, replace(batch, rewards=rewards), delays, norms))
        n, tokens = rewards.numel(), int(batch.response_mask.sum())
        loss = O.aggregate_loss(out.token_loss, batch.response_mask, rule.aggregation, max_length=T_MAX,
                                total_sequences=n, total_tokens=tokens)  # fmt: skip
        return flat_grad(loss, model)

    rewards = batch.rewards.double()  # shifted in float32, 0.2 - 3 would already differ by a rounding of 3
    base = gradient(rewards)
    assert base.norm() > 0
    torch.testing.assert_close(gradient(rewards - 3.0), base, rtol=1e-9, atol=1e-12)
    scale = 1.0 if name in STD_NORMALISED else 10.0
    torch.testing.assert_close(gradient(10.0 * rewards), scale * base, rtol=1e-9, atol=1e-12)


def test_fixture_exercises_truncation_and_masking(float64_actor_dir, char_tokenizer):
    """The batch above really has a VCPO-truncated trajectory and tokens over A-3PO's cap of 5, on which the two
    A-3PO entries differ (else the written-out comparison could not tell them apart)."""
    model = load_module(float64_actor_dir, "gmc").actor
    batch = make_batch(model, char_tokenizer)
    terms = terms_for(model, batch, torch.tensor([0] * G + [5] * G), torch.ones(2 * G, dtype=torch.float64))
    with torch.no_grad():
        assert VCPO(c=8.0)(terms).extra["vcpo/truncated_fraction"] > 0
        out, capped = A3PO(clip=0.2)(terms), A3PO(clip=0.2, behavior_cap=5.0)(terms)
    assert out.extra["a3po/over_cap_fraction"] > 0 and out.extra["a3po/clip_fraction"] > 0
    assert capped.extra["a3po/over_cap_fraction"] == out.extra["a3po/over_cap_fraction"]
    assert not torch.equal(out.token_loss, capped.token_loss)


def test_vcpo_grad_norms_and_baseline_equal_brute_force(float64_actor_dir, char_tokenizer, float64_rmsnorm):
    module = load_module(float64_actor_dir, "vcpo")
    batch = make_batch(module.actor, char_tokenizer)
    brute = brute_force_grad_norms_sq(module.actor, batch)
    torch.testing.assert_close(module.trajectory_grad_norms_sq(batch), brute, rtol=1e-10, atol=0)

    # b* = sum W r / sum W with W = w^2 ||grad||^2, written with plain ratios (no log space).
    w = torch.stack([torch.exp((direct_logprobs(module.actor, batch, i).detach() -
                                batch.behavior_logprobs[i, : int(batch.response_mask[i].sum())].double()).sum())
                     for i in range(2 * G)])  # fmt: skip
    r = batch.rewards.double().view(-1, G)
    weight = (w**2 * brute).view(-1, G)
    b_star = (weight * r).sum(-1) / weight.sum(-1)
    torch.testing.assert_close(
        vcpo_baseline(torch.log(w), brute, batch.rewards.double(), G), b_star, rtol=1e-10, atol=0
    )

    # Through the module (norms computed inside micro_batch_loss): advantages are (r - b*) / sigma.
    _, out, _, _ = module.micro_batch_loss(batch, batch)
    expected = ((r - b_star[:, None]) / r.std(-1, unbiased=False, keepdim=True)).reshape(-1)
    torch.testing.assert_close(out.advantages, expected, rtol=1e-9, atol=1e-12)
    # The per-trajectory backward passes leave no trace in .grad.
    assert all(p.grad is None for p in module.actor.parameters())


def test_vcpo_baseline_edge_cases():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.3, 0.6, 0.9], dtype=torch.float64)
    log_w = torch.tensor([800.0, 0.0, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64)  # w = e^800 would overflow
    norms = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0], dtype=torch.float64)  # group 2: all weights zero
    b = vcpo_baseline(log_w, norms, rewards, 3)
    torch.testing.assert_close(b, torch.tensor([1.0, 0.6], dtype=torch.float64))  # dominated row; plain mean
    with pytest.raises(ValueError, match="grad_norms_sq"):
        vcpo_baseline(log_w, norms[:4], rewards, 3)


def test_vcpo_without_grad_norms_names_the_field():
    terms = PolicyTerms(torch.zeros(2, 1), torch.zeros(2, 1), torch.ones(2, 1, dtype=torch.bool), torch.zeros(2),
                        torch.zeros(2, dtype=torch.long), 2)  # fmt: skip
    with pytest.raises(ValueError, match="grad_norms_sq"):
        VCPO(c=8.0)(terms)


@pytest.mark.parametrize(
    ("weights", "expected"),
    [
        ([1.0, 1.0, 1.0, 1.0], 1.0),  # on-policy: ESS = n
        ([1.0, 0.0, 0.0, 0.0], 0.5),  # one trajectory carries everything: ESS = 1, sqrt(1/4)
        ([2.0, 1.0, 1.0, 0.0], math.sqrt((4.0**2 / 6.0) / 4.0)),  # (sum w)^2 / sum w^2 = 16/6
        ([3.0, 1.0], math.sqrt((4.0**2 / 10.0) / 2.0)),
    ],
)
def test_ess_step_factor_on_hand_made_ratios(weights, expected):
    log_w = torch.log(torch.tensor(weights, dtype=torch.float64))
    assert float(ess_step_factor(log_w)) == pytest.approx(expected, rel=1e-12)
    assert float(ess_step_factor(log_w + 500.0)) == pytest.approx(expected, rel=1e-12)  # scale-free, no overflow


def test_vcpo_lr_scaled_for_one_step_then_restored():
    param = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.SGD([param], lr=0.1)
    param.grad = torch.ones(3)
    rule = VCPO()
    log_w = torch.log(torch.tensor([2.0, 1.0, 1.0], dtype=torch.float64))
    logged = rule.before_step([param], optimizer, {"log_rho": log_w})
    factor = math.sqrt((4.0**2 / 6.0) / 3.0)
    assert logged["vcpo/lr_factor"] == pytest.approx(factor, rel=1e-12)
    optimizer.step()
    torch.testing.assert_close(param.detach(), torch.full((3,), -0.1 * factor))  # the step used lr * factor
    rule.after_step(optimizer)
    assert optimizer.param_groups[0]["lr"] == 0.1


def unit(theta: float) -> torch.Tensor:
    return torch.tensor([math.cos(theta), math.sin(theta), 0.0], dtype=torch.float64)


def cos(a, b) -> float:
    return float(a @ b / (a.norm() * b.norm()))


@pytest.mark.parametrize("cosine", [-0.6, 0.0, 0.02, 0.05, 0.051, 0.2, 0.3, 0.31, 0.9])
def test_gac_shift_three_regimes(cosine):
    prev = torch.tensor([2.0, 0.0, 0.0], dtype=torch.float64)
    g = 3.0 * unit(math.acos(cosine)) + torch.tensor([0.0, 0.0, 1.5], dtype=torch.float64)
    measured, shift = gac_shift(float(g @ prev), float(g @ g), float(prev @ prev))
    assert measured == pytest.approx(cos(g, prev), abs=1e-12)
    projected = g - shift * prev
    torch.testing.assert_close(projected[1:], g[1:])  # the part orthogonal to g_prev is never touched
    if measured <= 0.05:
        assert shift == 0.0
    elif measured <= 0.30:
        assert cos(projected, prev) == pytest.approx(0.05, abs=1e-12)
        assert 0 < projected[0] < g[0]  # shrunk, not flipped
    else:
        assert cos(projected, prev) == pytest.approx(0.0, abs=1e-12)


def test_gac_projection_is_global_over_all_parameters():
    """Two tensors whose own cosines disagree (0.96 and -0.31): the rule uses the cosine of the concatenation."""
    a, b = (
        torch.nn.Parameter(torch.zeros(2, dtype=torch.float64)),
        torch.nn.Parameter(torch.zeros(3, dtype=torch.float64)),
    )
    rule = GAC()
    prev = [torch.tensor([1.0, 0.0], dtype=torch.float64), torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64)]
    a.grad, b.grad = prev[0].clone(), prev[1].clone()
    assert rule.before_step([a, b], None, {}) == {}  # first step: nothing to compare with
    new = [torch.tensor([1.0, 0.3], dtype=torch.float64), torch.tensor([0.2, -0.5, 1.5], dtype=torch.float64)]
    a.grad, b.grad = new[0].clone(), new[1].clone()
    logged = rule.before_step([a, b], None, {})

    g, p = torch.cat(new), torch.cat(prev)
    assert logged["gac/cosine"] == pytest.approx(cos(g, p), abs=1e-12)
    assert 0.05 < cos(g, p) <= 0.30  # the shrink regime
    # Reference by bisection: the multiple t of g_prev to keep so that cos(g_perp + t g_prev, g_prev) = 0.05.
    perp = g - (g @ p) / (p @ p) * p
    lo, hi = 0.0, float((g @ p) / (p @ p))
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cos(perp + mid * p, p) < 0.05 else (lo, mid)
    expected = perp + lo * p
    torch.testing.assert_close(torch.cat([a.grad, b.grad]), expected, rtol=1e-10, atol=1e-12)
    assert logged["gac/projected_cosine"] == pytest.approx(0.05, abs=1e-12)
    assert cos(torch.cat([a.grad, b.grad]), p) == pytest.approx(0.05, abs=1e-12)
    torch.testing.assert_close(torch.cat(rule.state_dict()["previous"]), g)  # keeps the raw gradient


def test_a3po_alpha_per_delay():
    torch.testing.assert_close(a3po_alpha(torch.tensor([0, 1, 5])), torch.tensor([1.0, 1.0, 0.2], dtype=torch.float64))
    with pytest.raises(ValueError, match="delays"):
        a3po_alpha(torch.tensor([-1]))


def hand_terms(token_logprobs, behavior, delays, rewards, group_size=2) -> PolicyTerms:
    mask = torch.ones_like(behavior, dtype=torch.bool)
    return PolicyTerms(token_logprobs, behavior, mask, rewards, delays, group_size)


def a3po_direct(logprobs, behavior, mask, delays, rewards, group_size, eps, cap):
    """A-3PO's per-token loss and its gradient in ``log pi_theta``, one token at a time in Python floats (float64).

    ``log pi_prox = alpha l + (1 - alpha) log pi_theta`` with ``alpha = 1 / max(1, tau)``, ``r = pi_theta /
    pi_prox``, ``w = pi_prox / pi_b`` (0 when ``cap`` is set and ``w > cap``), ``A = r_i - mean(group)``, and
    ``loss_t = -w min(r A, clip(r, 1 - eps, 1 + eps) A)``. With ``pi_prox`` held constant (the stop-gradient),
    ``d loss_t / d log pi_theta = -w r A`` where the unclipped branch is the minimum, else 0.
    """
    n, length = logprobs.shape
    loss, grad = torch.zeros(n, length, dtype=torch.float64), torch.zeros(n, length, dtype=torch.float64)
    for i in range(n):
        group = rewards[(i // group_size) * group_size : (i // group_size + 1) * group_size].tolist()
        adv = float(rewards[i]) - sum(group) / group_size
        alpha = 1.0 / max(1, int(delays[i]))
        for t in range(length):
            if not mask[i, t]:
                continue
            lp, lb = float(logprobs[i, t]), float(behavior[i, t])
            log_prox = alpha * lb + (1.0 - alpha) * lp
            r, w = math.exp(lp - log_prox), math.exp(log_prox - lb)
            if cap is not None and w > cap:
                w = 0.0
            unclipped, clipped = r * adv, min(max(r, 1.0 - eps), 1.0 + eps) * adv
            loss[i, t] = -w * min(unclipped, clipped)
            grad[i, t] = -w * r * adv if unclipped <= clipped else 0.0
    return loss, grad


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("name", ["a3po", "a3po_capped"])
def test_a3po_equals_its_equation_token_by_token(name, seed):
    """Loss, gradient and the ``token_mean`` aggregate against :func:`a3po_direct`, with padding, mixed delays and
    one token whose ``pi_prox / pi_b`` is ``e^3 > 5`` (kept by ``a3po``, masked by ``a3po_capped``)."""
    gen = torch.Generator().manual_seed(seed)
    n, length = 6, 5
    behavior = -3.0 * torch.rand(n, length, generator=gen, dtype=torch.float64)
    gap = 1.5 * torch.randn(n, length, generator=gen, dtype=torch.float64)
    gap[5, 0] = 3.5  # tau = 7: w = exp((6/7) 3.5) = e^3; row 5 has a negative advantage, so it has gradient
    mask = torch.arange(length)[None, :] < torch.tensor([5, 3, 5, 1, 4, 5])[:, None]
    logprobs = (behavior + gap).requires_grad_(True)
    delays = torch.tensor([0, 1, 3, 3, 7, 7])
    rewards = torch.tensor([1.0, 0.0, 0.3, 0.9, 1.0, 0.2], dtype=torch.float64)
    entry = RULES[name]()
    out = entry(PolicyTerms(logprobs, behavior, mask, rewards, delays, 2))
    cap = 5.0 if name == "a3po_capped" else None
    loss, grad = a3po_direct(logprobs.detach(), behavior, mask, delays, rewards, 2, entry.threshold, cap)
    torch.testing.assert_close(out.token_loss, loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(torch.autograd.grad(out.token_loss.sum(), logprobs)[0], grad, rtol=1e-12, atol=1e-14)
    assert grad[5, 0] != 0 if cap is None else grad[5, 0] == 0  # the over-cap token
    assert entry.aggregation == "token_mean"  # token sum over the count of valid tokens
    total = O.aggregate_loss(out.token_loss, mask, entry.aggregation, max_length=length, total_sequences=n,
                             total_tokens=int(mask.sum()))  # fmt: skip
    assert float(total.detach()) == pytest.approx(float(loss.sum()) / int(mask.sum()), rel=1e-12)


def test_a3po_keeps_the_factor_over_five_and_a3po_capped_masks_it():
    # tau = 5, alpha = 0.2: pi_prox / pi_b = exp(0.8 (log pi - l)); the cap 5 is crossed at log pi - l = ln(5)/0.8.
    edge = math.log(5.0) / 0.8
    gap = torch.tensor([[0.0, edge - 1e-6, edge + 1e-6], [-0.3, 0.5, 4.0]], dtype=torch.float64)
    behavior = torch.full_like(gap, -2.0)
    logprobs = (behavior + gap).requires_grad_(True)
    terms = hand_terms(logprobs, behavior, torch.tensor([5, 5]), torch.tensor([1.0, 0.0], dtype=torch.float64))
    out, capped = A3PO(clip=0.2)(terms), A3PO(clip=0.2, behavior_cap=5.0)(terms)
    weight, ratio = torch.exp(0.8 * gap), torch.exp(0.2 * gap)
    adv = torch.tensor([[0.5], [-0.5]], dtype=torch.float64)
    expected = -weight * torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    torch.testing.assert_close(out.token_loss, expected, rtol=1e-12, atol=1e-14)  # unclipped: weights up to e^3.2
    over = torch.tensor([[False, False, True], [False, False, True]])
    torch.testing.assert_close(capped.token_loss, expected.masked_fill(over, 0.0), rtol=1e-12, atol=1e-14)
    (grad,) = torch.autograd.grad(out.token_loss.sum(), logprobs)
    (grad_capped,) = torch.autograd.grad(capped.token_loss.sum(), logprobs)
    # Negative advantage, unclipped branch: the gradient carries the whole token ratio pi_theta / pi_b = e^4.
    assert float(grad[1, 2]) == pytest.approx(0.5 * math.exp(4.0), rel=1e-12)
    assert grad_capped[1, 2] == 0.0 and grad_capped[0, 2] == 0.0 and grad_capped[0, 0] != 0.0
    torch.testing.assert_close(grad_capped.masked_fill(over, 0.0), grad.masked_fill(over, 0.0))  # others agree
    for o in (out, capped):
        assert float(o.extra["a3po/over_cap_fraction"]) == pytest.approx(2 / 6)


def test_a3po_behavior_weight_unclipped_capped_and_finite():
    log_w = torch.tensor([[0.0, math.log(5.0), math.log(5.0) + 1e-9, 200.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True, False]])
    weight, kept = a3po_behavior_weight(log_w, mask, None)
    torch.testing.assert_close(weight, torch.tensor([[1.0, 5.0, 5.0, 0.0]], dtype=torch.float64))  # no cap
    assert torch.equal(kept, mask)
    weight, kept = a3po_behavior_weight(log_w, mask, 5.0)
    torch.testing.assert_close(weight, torch.tensor([[1.0, 5.0, 0.0, 0.0]], dtype=torch.float64))  # masked, not 5
    assert kept.tolist() == [[True, True, False, False]]
    with pytest.raises(ValueError, match="like mask"):
        a3po_behavior_weight(log_w[0], mask[0], None)
    # float32, a factor beyond float range and a zero advantage: the token contributes 0, not NaN.
    behavior = torch.full((2, 2), -150.0)
    logprobs = torch.tensor([[-1.0, -2.0], [-1.0, -2.0]], requires_grad=True)
    terms = hand_terms(logprobs, behavior, torch.tensor([4, 4]), torch.tensor([1.0, 1.0]))
    out = A3PO(clip=0.2)(terms)
    assert torch.equal(out.token_loss, torch.zeros(2, 2))
    assert torch.isfinite(torch.autograd.grad(out.token_loss.sum(), logprobs)[0]).all()


@pytest.mark.parametrize("rule", [A3PO(clip=0.2), A3PO(clip=0.2, behavior_cap=5.0)])
@pytest.mark.parametrize("delay", [0, 1])
def test_a3po_is_ppo_clip_at_small_delay(rule, delay):
    gen = torch.Generator().manual_seed(delay)
    behavior = -torch.rand(4, 5, generator=gen, dtype=torch.float64) * 3
    logprobs = (behavior + 0.5 * torch.randn(4, 5, generator=gen, dtype=torch.float64)).requires_grad_(True)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    out = rule(hand_terms(logprobs, behavior, torch.full((4,), delay), rewards))
    adv = O.group_centered_advantages(rewards, 2)
    ppo = O.ppo_clip_token_loss(logprobs, behavior, torch.ones_like(behavior, dtype=torch.bool), adv, 0.2)
    assert torch.equal(out.token_loss, ppo)
    assert torch.equal(*(torch.autograd.grad(x.sum(), logprobs)[0] for x in (out.token_loss, ppo)))


@pytest.mark.parametrize(("name", "cap"), [("cispo", 1.28), ("tis", 2.0)])
def test_token_ratio_truncation(name, cap):
    gap = torch.tensor([[-1.0, 0.0, 0.2], [0.5, 1.0, 3.0]], dtype=torch.float64)
    behavior = torch.full_like(gap, -1.5)
    logprobs = (behavior + gap).requires_grad_(True)
    rewards = torch.tensor([1.0, 0.0], dtype=torch.float64)
    out = RULES[name]()(hand_terms(logprobs, behavior, torch.zeros(2, dtype=torch.long), rewards))
    adv = torch.tensor([1.0, -1.0]) if name == "cispo" else torch.tensor([0.5, -0.5])  # std-normalised vs centred
    (grad,) = torch.autograd.grad(out.token_loss.sum(), logprobs)
    torch.testing.assert_close(grad, -torch.exp(gap).clamp(max=cap) * adv.double()[:, None])
    assert float(out.extra[f"{name}/truncated_fraction"]) == pytest.approx(3 / 6 if name == "cispo" else 2 / 6)


@pytest.mark.parametrize("name", BASELINES)
def test_micro_batches_of_groups_add_up_to_the_full_batch(name, float64_actor_dir, char_tokenizer):
    module = load_module(float64_actor_dir, name)
    batch = make_batch(module.actor, char_tokenizer)
    whole = flat_grad(module.micro_batch_loss(batch, batch)[0], module.actor)
    parts = sum(
        flat_grad(module.micro_batch_loss(batch, batch.groups_slice(b, b + 1))[0], module.actor) for b in range(2)
    )
    torch.testing.assert_close(parts, whole, rtol=1e-9, atol=1e-12)


class DelaysSeen(GMCModule):
    """``GMCModule`` noting, for every micro-batch, the delays its rule was given and the part's own at that step."""

    def micro_batch_loss(self, batch, part, delays=None):
        self.seen = [*getattr(self, "seen", []), (delays.clone(), part.delays(self.global_step))]
        return super().micro_batch_loss(batch, part, delays)


def test_each_micro_batch_gets_its_own_groups_delays(float64_actor_dir, char_tokenizer, tmp_path):
    """training_step computes the batch's delays once and hands each micro-batch its rows of them (A-3PO reads them)."""
    module = DelaysSeen(actor=str(float64_actor_dir), correction=A3PO(), dtype="float64", max_response_length=T_MAX,
                        micro_batch_groups=1)  # fmt: skip
    batch = replace(make_batch(module.actor, char_tokenizer), versions=torch.tensor([-3, -1]))  # delays 3, 1 at step 0
    trainer = pl.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader([batch, batch], batch_size=None))
    assert [given.tolist() for given, _ in module.seen] == [[3] * G, [1] * G, [4] * G, [2] * G]
    assert all(torch.equal(given, own) for given, own in module.seen)


class Recorder(pl.Callback):
    """Loss, the optimizer's lr at the step, and the logged scalars of every training step."""

    def __init__(self) -> None:
        self.losses, self.step_lrs, self.metrics, self.rule_states = [], [], [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        # the rule replaces (never mutates) its state, so a reference will do
        self.rule_states.append(pl_module.correction.state_dict())

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.step_lrs.append(optimizer.param_groups[0]["lr"])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


class MemoryLogger(Logger):
    """Keeps every ``log_metrics`` call, by step (the module logs its per-step scalars straight to loggers)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_step: dict[int, dict[str, float]] = {}

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics, step=None) -> None:
        self.by_step.setdefault(step, {}).update(metrics)

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass


def fit(correction: str, steps: int, tmp_path, *, planned: int | None = None, ckpt_path=None):
    module = GMCModule(correction=RULES[correction](), micro_batch_groups=2)
    data = tiny_data(2, group_size=4, batch_prompts=4,
                             total_updates=planned or steps)  # fmt: skip
    recorder, logger = Recorder(), MemoryLogger()
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=steps, logger=logger, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=tmp_path,
        callbacks=[WeightSync(), recorder],
    )  # fmt: skip
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    recorder.metrics = [logger.by_step[step] for step in sorted(logger.by_step)]  # the logged scalars, step by step
    return trainer, module, recorder


def test_gac_state_survives_checkpoint_and_resume(tmp_path):
    trainer, module, _ = fit("gac", 2, tmp_path / "a", planned=3)
    saved = [t.clone() for t in module.correction.previous]
    ckpt = tmp_path / "gac.ckpt"
    trainer.save_checkpoint(ckpt)

    trainer2, _, rec = fit("gac", 3, tmp_path / "b", ckpt_path=str(ckpt))
    assert trainer2.global_step == 3 and len(rec.losses) == 1
    restored = rec.rule_states[0]["previous"]  # the step rule's state when the first resumed step began
    assert len(restored) == len(saved) and all(torch.equal(a, b) for a, b in zip(restored, saved, strict=True))
    assert "gac/cosine" in rec.metrics[0]  # a fresh rule logs no cosine on its first step: this one had g_prev


@pytest.mark.parametrize("name", BASELINES)
def test_cli_selects_each_baseline_with_its_defaults(name, tmp_path, monkeypatch):
    """The embedded tiny config plus the rule's class builds each baseline with its own defaults."""
    from lit_gmc.cli import GMCCLI, embedded_default

    monkeypatch.setattr("sys.argv", ["lit_gmc"])
    expected = RULES[name]()
    chosen = [f"--model.correction={type(expected).__name__}"]
    if name == "a3po_capped":
        chosen.append("--model.correction.behavior_cap=5")
    args = ["--config", embedded_default(), *chosen, "--trainer.logger=false",
            f"--trainer.default_root_dir={tmp_path}"]  # fmt: skip
    cli = GMCCLI(args=args, run=False)
    rule = cli.model.correction
    assert type(rule) is type(expected) and vars(rule) == vars(expected)  # its threshold, aggregation, step state
