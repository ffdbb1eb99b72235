"""The estimator lab (lit_gmc.lab): a rule's update through the lab equals the learner's backward, unclipped IS is
unbiased (exactly, and within its interval), every trajectory rule is the on-policy gradient at delay 0, the exact
sums equal the Monte-Carlo estimates within their error, a biased rule is reported biased, TIC's bias is Remark 8's
at every G, and bad input gets one message.

A random float64 tiny Qwen3 (hidden 16) is theta_b; theta is it moved along a fixed random direction. Responses of
one token (46 of them) or two (2,071) make every expectation a finite sum.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from test_baselines import flat_grad

from lit_gmc import objectives as O
from lit_gmc.__main__ import run
from lit_gmc.actor import load_actor
from lit_gmc.batch import RolloutGroup, collate_groups
from lit_gmc.corrections import Correction, PolicyTerms
from lit_gmc.errors import UserError
from lit_gmc.lab.measure import (
    PromptPolicies,
    all_groups,
    batch_statistics,
    draw_groups,
    expected_coefficients,
    kept_rows,
    loss_gradients,
)
from lit_gmc.lab.run import Cell, Settings, measure_delay
from lit_gmc.lab.sampled import measure_delay_sampled
from lit_gmc.lab.space import all_responses, prefix_scores, prompt_space, response_count, token_logprobs
from lit_gmc.logprobs import response_logprobs
from lit_gmc.module import GMCModule
from lit_gmc.rules import GMC, GRPO, GSPO, IS, M2PO, TIC, VCPO, SeqTIS

PROMPTS = (("1+2=", "3"), ("4+4=", "8"))


def digit_first(completions: list[str], answer: str) -> list[float]:
    """Reward 1 when a completion starts with a digit (about a fifth of the tokens): a reward that varies."""
    del answer
    return [float(c[:1].isdigit()) for c in completions]


@pytest.fixture(scope="module")
def policies(float64_actor_dir):
    """``(theta_b, theta, tokenizer)``: the float64 actor, and a copy moved along a fixed random direction."""
    behavior, tokenizer = load_actor(str(float64_actor_dir), torch.float64)
    current, _ = load_actor(str(float64_actor_dir), torch.float64)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in current.parameters():
            p.add_(3.0 * torch.randn(p.shape, generator=gen, dtype=p.dtype) * p.abs().mean())
    return behavior.eval(), current.eval(), tokenizer


def spaces_and_data(policies, max_tokens: int) -> tuple[list, list, list[PromptPolicies]]:
    behavior, current, tokenizer = policies
    spaces = [prompt_space(p, a, tokenizer, max_tokens, digit_first) for p, a in PROMPTS]
    lb = [token_logprobs(behavior, s) for s in spaces]
    data = [PromptPolicies(s, b, token_logprobs(current, s)) for s, b in zip(spaces, lb, strict=True)]
    return spaces, lb, data


def lab_update(model, data: PromptPolicies, rule, group: torch.Tensor, delay: int) -> torch.Tensor:
    """``g = -sum_{i,t} (dL/d log pi) grad log pi`` of one group through the lab's pieces."""
    grads = loss_gradients(type(rule).__name__, rule, data, group[None], delay=delay,
                           grad_norms_sq=row_norms(model, data, group) if rule.needs_grad_norms else None)  # fmt: skip
    scores, prefix = prefix_scores(model, data.space, group)
    coefficients = -grads.loss_grads[0][data.space.mask[group]]  # (U,)
    return (torch.zeros(scores.shape[0], dtype=torch.float64).index_add_(0, prefix, coefficients)) @ scores


def row_norms(model, data: PromptPolicies, rows: torch.Tensor) -> torch.Tensor:
    norms = torch.zeros(data.space.size, dtype=torch.float64)
    for row in rows.tolist():
        scores, prefix = prefix_scores(model, data.space, torch.tensor([row]))
        norms[row] = scores[prefix].sum(0).square().sum()  # the row's score: the sum of its tokens'

    return norms


# --- The response space and its scores ---------------------------------------------------------------------------


def test_every_response_is_enumerated_once_and_the_probabilities_sum_to_one(policies):
    ids, mask = all_responses(46, eos_id=1, pad_id=0, max_tokens=2)
    assert ids.shape == (response_count(46, 2), 2) == (2071, 2)
    assert len({tuple(row[m].tolist()) for row, m in zip(ids, mask, strict=True)}) == 2071
    assert ((ids[:, 0] == 1) == ~mask[:, 1]).all()  # a response stops at its first EOS, and only there
    _, _, data = spaces_and_data(policies, 2)
    for d in data:
        assert float(d.p_behavior.sum()) == pytest.approx(1.0, abs=1e-12)
        assert float(d.p_current.sum()) == pytest.approx(1.0, abs=1e-12)
    with pytest.raises(UserError, match="--max-tokens 4"):
        all_responses(46, 1, 0, 4)


def test_log_probs_and_prefix_scores_are_the_learners(policies, float64_rmsnorm):
    behavior, _, tokenizer = policies
    space = prompt_space("1+2=", "3", tokenizer, 2, digit_first)
    rows = torch.tensor([0, 5, 46, 47])  # an EOS alone, a token then EOS, two full responses of one first token
    ids = space.rows()[rows]
    attention = torch.cat([torch.ones(4, space.prompt_ids.numel(), dtype=torch.bool), space.mask[rows]], dim=1)
    learner, _ = response_logprobs(behavior, ids, attention, space.prompt_ids.numel())  # (4, 2)
    mask = space.mask[rows]
    torch.testing.assert_close(token_logprobs(behavior, space)[rows], learner.masked_fill(~mask, 0.0))
    scores, prefix = prefix_scores(behavior, space, rows)
    assert scores.shape[0] == int(mask.sum()) - 1  # rows 46 and 47 start alike: that score once
    for k, (r, t) in enumerate(torch.nonzero(mask).tolist()):
        grads = torch.autograd.grad(learner[r, t], list(behavior.parameters()), retain_graph=True, allow_unused=True)
        expected = torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1)
                              for g, p in zip(grads, behavior.parameters(), strict=True)])  # fmt: skip
        torch.testing.assert_close(scores[prefix[k]], expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("rule", [GMC(), TIC(), GRPO(), GSPO(eps_low=0.2, eps_high=0.3), VCPO(), SeqTIS()],
                         ids=lambda r: type(r).__name__)  # fmt: skip
def test_a_groups_update_through_the_lab_is_the_learners_backward(rule, policies, float64_actor_dir, float64_rmsnorm):
    behavior, current, _ = policies
    _, _, data = spaces_and_data(policies, 2)
    d = data[0]
    group = torch.tensor([7, 300, 1500, 7])  # a repeated response, as draws with replacement give
    space = d.space
    module = GMCModule(actor=str(float64_actor_dir), correction=rule, dtype="float64", max_response_length=2)
    module.actor.load_state_dict(current.state_dict())
    responses = RolloutGroup(
        prompt_id=0, prompt=space.prompt, answer=space.answer, prompt_ids=space.prompt_ids,
        response_ids=space.response_ids[group], response_mask=space.mask[group],
        behavior_logprobs=d.behavior[group].float(), finish_reasons=["stop"] * 4, rewards=space.rewards[group],
        version=0,
    )  # fmt: skip
    batch = collate_groups([responses], pad_id=0)
    batch = batch.__class__(**{**vars(batch), "behavior_logprobs": d.behavior[group]})  # keep float64
    loss, *_ = module.micro_batch_loss(batch, batch, torch.full((4,), 3))
    learner = -flat_grad(loss, module.actor)
    torch.testing.assert_close(lab_update(current, d, rule, group, 3), learner, rtol=1e-8, atol=1e-11)


def test_update_losses_are_aggregate_loss_of_each_group_alone():
    gen = torch.Generator().manual_seed(0)
    loss = torch.randn(12, 5, generator=gen, dtype=torch.float64)
    mask = torch.rand(12, 5, generator=gen) > 0.3
    mask[4] = False
    for mode in ("seq_sum_over_T", "token_mean", "seq_mean_token_mean"):
        per_group = O.update_losses(loss.masked_fill(~mask, 0), mask, mode, max_length=5, group_size=3)
        alone = [O.aggregate_loss(loss[b:b + 3].masked_fill(~mask[b:b + 3], 0), mask[b:b + 3], mode, max_length=5,
                                  total_sequences=3, total_tokens=int(mask[b:b + 3].sum())) for b in range(0, 12, 3)]
        torch.testing.assert_close(per_group, torch.stack(alone))


# --- What the lab measures -----------------------------------------------------------------------------------------


def exact_mean(model, datas: list[PromptPolicies], rule, group_size: int, delay: int = 4) -> torch.Tensor:
    """``E[g]`` summed over every group of every response, averaged over prompts."""
    total = 0
    for d in datas:
        coefficients, _, left_out = expected_coefficients(type(rule).__name__, rule, d, torch.arange(d.space.size),
                                                          group_size, delay=delay)  # fmt: skip
        assert left_out == pytest.approx(0.0, abs=1e-12)
        total = total + weighted(model, d, coefficients)
    return total / len(datas)


def weighted(model, d: PromptPolicies, coefficients: torch.Tensor) -> torch.Tensor:
    rows = torch.arange(d.space.size)
    scores, prefix = prefix_scores(model, d.space, rows)
    per_token = coefficients[d.space.mask]
    return torch.zeros(scores.shape[0], dtype=torch.float64).index_add_(0, prefix, per_token) @ scores


def true_gradient(model, datas: list[PromptPolicies]) -> torch.Tensor:
    return sum(weighted(model, d, d.true_coefficients()) for d in datas) / len(datas)


def test_unclipped_is_is_exactly_unbiased_and_tic_is_biased_by_remark_8_at_every_g(policies, float64_rmsnorm):
    _, current, _ = policies
    _, _, datas = spaces_and_data(policies, 1)
    h = true_gradient(current, datas)
    assert datas[0].divergences()["chi2"] > 0.05  # the policies are apart
    for g in (2, 3):
        assert (exact_mean(current, datas, IS(), g) - h).norm() <= 1e-10 * h.norm()
        tic = exact_mean(current, datas, TIC(), g) - h
        limit = sum(weighted(current, d, d.tic_limit_coefficients(0.28)) for d in datas) / len(datas)
        assert tic.norm() > 0.05 * h.norm()
        torch.testing.assert_close(tic, limit, rtol=1e-9, atol=1e-12)  # TIC's bias: the same vector at G = 2 and 3
    gmc = [(exact_mean(current, datas, GMC(), g) - h).norm() for g in (2, 3)]
    assert gmc[0] > gmc[1] > 0  # GMC's shrinks with G


def test_at_delay_zero_every_trajectory_rule_is_the_on_policy_gradient(policies, float64_rmsnorm):
    behavior, _, tokenizer = policies
    spaces = [prompt_space(p, a, tokenizer, 1, digit_first) for p, a in PROMPTS]
    datas = [PromptPolicies(s, token_logprobs(behavior, s), token_logprobs(behavior, s)) for s in spaces]
    h = true_gradient(behavior, datas)
    for rule in (IS(), TIC(), GMC()):  # leave-one-out advantages, seq_sum_over_T: exactly grad J / T
        assert (exact_mean(behavior, datas, rule, 3, delay=0) - h).norm() <= 1e-10 * h.norm()
    for cls in (SeqTIS,):  # group-centred advantages: (G - 1) / G of it
        torch.testing.assert_close(exact_mean(behavior, datas, cls(aggregation="seq_sum_over_T"), 3, delay=0),
                                   2 / 3 * h, rtol=1e-9, atol=1e-12)  # fmt: skip


class HalfIS(Correction):
    """A deliberately biased rule: half the importance ratio."""

    def coefficients(self, terms: PolicyTerms, log_rho: torch.Tensor) -> torch.Tensor:
        return 0.5 * O.is_coefficients(log_rho)


class Exploding(Correction):
    """A rule that raises."""

    def coefficients(self, terms: PolicyTerms, log_rho: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("no coefficients today")


class CallWideMean(Correction):
    """Normalises by the mean ratio of the whole call without saying so (couples_groups left False)."""

    def coefficients(self, terms: PolicyTerms, log_rho: torch.Tensor) -> torch.Tensor:
        rho = O.is_coefficients(log_rho)
        return rho / rho.mean()


def test_measure_delay_reports_is_unbiased_a_biased_rule_biased_and_exact_within_monte_carlo(
    policies, float64_rmsnorm
):
    _, current, _ = policies
    spaces, lb, datas = spaces_and_data(policies, 1)
    cells = [Cell("IS", IS(), 2, exact=True), Cell("HalfIS", HalfIS(), 2, exact=True), Cell("GMC", GMC(), 2, True),
             Cell("TIC", TIC(), 3)]
    record, cells_out = measure_delay(current, spaces, lb, 4, cells, Settings(draws=20000, batches=10, omit=0.0))
    _, coupled = measure_delay(current, spaces, lb, 4, [Cell("M2PO", M2PO(), 2, True)], Settings(draws=50, omit=0.0))
    by = {(c["rule"], c["group_size"]): c for c in [*cells_out, *coupled]}
    h = record["true_gradient_norm"]
    assert h > 0 and record["chi2"] > 0.05 and record["kl_behavior_current"] > 0
    assert by[("IS", 2)]["exact"]["relative_bias"] < 1e-9
    assert by[("IS", 2)]["mc"]["bias_low"] == 0.0  # 0 lies in its interval
    assert by[("HalfIS", 2)]["exact"]["relative_bias"] == pytest.approx(0.5, rel=1e-9)  # E[g] = h / 2 exactly
    assert by[("HalfIS", 2)]["mc"]["bias_low"] > 0.3 * h  # and the Monte Carlo one says so
    for name in ("GMC", "HalfIS"):  # the exact bias lies within the Monte-Carlo interval
        cell = by[(name, 2)]
        assert cell["mc"]["bias_low"] <= cell["exact"]["bias"] <= cell["mc"]["bias_high"], cell
    assert by[("M2PO", 2)]["exact"] is not None  # called once per group (couples_groups), 46^2 groups: still summed
    assert by[("TIC", 3)]["mc"]["bias_low"] > 0  # TIC is biased at G = 3 too
    assert by[("TIC", 3)]["bounds"]["second_moment"] >= by[("TIC", 3)]["mc"]["second_moment"]["value"]
    assert by[("GMC", 2)]["bounds"]["bias_chi2"] >= by[("GMC", 2)]["exact"]["bias"]


def test_sampled_responses_give_the_enumerated_measurements_within_their_errors(policies, float64_rmsnorm):
    """Where both apply (one-token responses), the sampled mode's h, chi^2 and biases agree with the exact sums."""
    behavior, current, tokenizer = policies
    spaces, lb, _ = spaces_and_data(policies, 1)
    cells = [Cell("IS", IS(), 2, exact=True), Cell("GMC", GMC(), 2, exact=True), Cell("TIC", TIC(), 3)]
    record, exact = measure_delay(current, spaces, lb, 4, cells, Settings(draws=4000, omit=0.0, max_tokens=1))
    sampled_record, sampled = measure_delay_sampled(behavior, current, PROMPTS, tokenizer, digit_first, 4, cells,
                                                    Settings(draws=4000, max_tokens=1))  # fmt: skip
    assert sampled_record["true_gradient_norm"] == pytest.approx(record["true_gradient_norm"], rel=0.05)
    for estimated, truth in zip(sampled_record["prompts"], record["prompts"], strict=True):
        assert abs(estimated["chi2"] - truth["chi2"]) < 4 * estimated["chi2_se"]
        assert abs(estimated["reward_current"] - truth["reward_current"]) < 4 * estimated["reward_current_se"]
    by = {c["rule"]: c for c in sampled}
    assert by["IS"]["mc"]["bias_low"] == 0.0 and by["TIC"]["mc"]["bias_low"] > 0
    gmc = next(c for c in exact if c["rule"] == "GMC")["exact"]["bias"]
    assert by["GMC"]["mc"]["bias_low"] <= gmc <= by["GMC"]["mc"]["bias_high"]
    tic = next(c for c in exact if c["rule"] == "TIC")["mc"]
    assert by["TIC"]["mc"]["bias_low"] <= tic["bias_high"] and tic["bias_low"] <= by["TIC"]["mc"]["bias_high"]
    assert all(c["exact"] is None for c in sampled)  # nothing is summed exactly over samples


def test_batch_statistics_are_unbiased_for_known_gaussian_draws():
    """Draws g = mu + noise with known mu and E||g||^2: the U-statistics' intervals hold them (seeded)."""
    gen = torch.Generator().manual_seed(1)
    mu, h = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64), torch.tensor([1.0, 1.0, 0, 0], dtype=torch.float64)
    draws = mu + torch.randn(4000, 4, generator=gen, dtype=torch.float64)
    means = draws.view(10, 400, 4).mean(1)
    stats = batch_statistics(means, h, draws.square().sum(-1), torch.ones(4000, dtype=torch.float64))
    assert stats["bias_sq"].low <= 1.0 <= stats["bias_sq"].high  # ||mu - h||^2 = 1
    assert stats["second_moment"].low <= 5.0 <= stats["second_moment"].high  # ||mu||^2 + 4
    assert stats["cosine"].low <= 1 / math.sqrt(2) <= stats["cosine"].high


def test_batch_statistics_average_to_the_truth_where_a_plug_in_would_not():
    """Over 2,000 independent runs of 20 draws in 5 batches, bias^2 and ||E g||^2 average to their true values; the
    plug-in ``||mean - h||^2`` would be off by ``tr(Sigma) / 20 = 0.2``."""
    gen = torch.Generator().manual_seed(2)
    mu, h = torch.tensor([1.0, 0.5, 0.0, 0.0], dtype=torch.float64), torch.tensor([1.0, 0.5, 0, 0], dtype=torch.float64)
    bias_sq, mean_sq, plug_in = [], [], []
    for _ in range(2000):
        draws = mu + torch.randn(20, 4, generator=gen, dtype=torch.float64)
        stats = batch_statistics(draws.view(5, 4, 4).mean(1), h, draws.square().sum(-1), torch.ones(20))
        bias_sq.append(stats["bias_sq"].value)
        mean_sq.append(stats["mean_norm_sq"].value)
        plug_in.append(float((draws.mean(0) - h).square().sum()))
    bias_sq, mean_sq, plug_in = (torch.tensor(x, dtype=torch.float64) for x in (bias_sq, mean_sq, plug_in))
    assert abs(float(bias_sq.mean())) < 3 * float(bias_sq.std()) / math.sqrt(2000)  # the truth is 0
    assert abs(float(mean_sq.mean()) - 1.25) < 3 * float(mean_sq.std()) / math.sqrt(2000)
    assert float(plug_in.mean()) == pytest.approx(0.2, rel=0.1)


def test_the_true_gradient_is_the_derivative_of_the_expected_reward_over_t(policies, float64_rmsnorm):
    """``grad J / T`` as the lab forms it (a weighting of score vectors) against autograd of ``J / T`` written out:
    ``(1/T) mean_prompts sum_y pi_theta(y) r(y)`` over every response of two tokens, through the learner's forward."""
    _, current, _ = policies
    spaces, _, datas = spaces_and_data(policies, 2)
    lab = true_gradient(current, datas)
    total = 0
    for space in spaces:
        ids = space.rows()
        attention = torch.cat([torch.ones(space.size, space.prompt_ids.numel(), dtype=torch.bool), space.mask], dim=1)
        logprobs, _ = response_logprobs(current, ids, attention, space.prompt_ids.numel())
        total = total + (logprobs.masked_fill(~space.mask, 0).sum(-1).exp() * space.rewards).sum() / space.max_tokens
    torch.testing.assert_close(lab, flat_grad(total / len(spaces), current), rtol=1e-8, atol=1e-12)


def test_a_rule_that_raises_or_couples_groups_silently_gets_one_message(policies):
    _, _, datas = spaces_and_data(policies, 1)
    groups = draw_groups(datas[0].p_behavior, 8, 2, torch.Generator().manual_seed(0))
    with pytest.raises(UserError, match="--rules Exploding: the rule raised RuntimeError .* no coefficients today"):
        loss_gradients("Exploding", Exploding(), datas[0], groups, delay=1)
    from lit_gmc.lab.measure import check_separable

    with pytest.raises(UserError, match="--rules CallWideMean: .*couples_groups = True"):
        check_separable("CallWideMean", CallWideMean(), datas[0], groups, 1)
    check_separable("GMC", GMC(), datas[0], groups, 1)  # a per-group rule passes


def test_kept_rows_hold_all_but_the_omitted_mass_and_groups_are_every_ordered_tuple():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    assert kept_rows(p, omit=0.1).tolist() == [0, 1, 2]
    assert kept_rows(p, torch.flip(p, [0]), omit=0.1).tolist() == [0, 1, 2, 3]
    assert kept_rows(p, omit=0.0).tolist() == [0, 1, 2, 3]
    assert all_groups(torch.tensor([3, 5]), 2).tolist() == [[3, 3], [3, 5], [5, 3], [5, 5]]


# --- The command -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_folders(policies, tmp_path_factory):
    behavior, current, tokenizer = policies
    root = tmp_path_factory.mktemp("policies")
    for name, model in (("behavior", behavior), ("current", current)):
        model.float().save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        model.double()
    return root


def test_estimate_on_two_folders_writes_the_table_the_figures_and_the_numbers(two_folders, tmp_path, capsys):
    out = tmp_path / "lab"
    run(["estimate", "--behavior", str(two_folders / "behavior"), "--current", str(two_folders / "current"),
         "--delay", "3", "--out", str(out), "--rules", "IS", "TIC", "GMC", "GRPO", "--group-sizes", "2", "3",
         "--sweep-group-sizes", "2", "3", "4", "--max-tokens", "1", "--prompts", "2", "--candidates", "3",
         "--draws", "200", "--batches", "5", "--omit", "0"])  # fmt: skip
    assert "estimator lab:" in capsys.readouterr().out
    data = json.loads((out / "lab.json").read_text())
    assert [d["delay"] for d in data["delays"]] == [3]
    assert {(c["rule"], c["group_size"]) for c in data["cells"]} == {
        *((r, g) for r in ("IS", "TIC", "GMC", "GRPO") for g in (2, 3)), ("IS", 4), ("TIC", 4), ("GMC", 4)}
    rows = (out / "lab.csv").read_text().splitlines()
    assert rows[0].startswith("rule,group_size,delay") and len(rows) == 1 + 11 + 4  # 4 exact rows (G = 2)
    assert "| TIC | 4 | 3 | mc |" in (out / "lab.md").read_text()
    for name in ("bias_vs_group_size", "bias_vs_delay", "second_moment_vs_delay"):
        assert (out / f"{name}.png").stat().st_size > 10_000 and (out / f"{name}.pdf").is_file()


def test_estimate_trains_the_current_policies_from_the_embedded_default_once(tmp_path, capsys):
    """The default path, shrunk: ``lit-gmc fit`` trains theta_1 on theta_0's rollouts, the lab measures delays 0 and
    1, and a second call reuses the trained policies (the same command recorded beside them)."""
    argv = ["estimate", "--out", str(tmp_path), "--delays", "0", "1", "--rules", "IS", "GMC", "--group-sizes", "2",
            "--sweep-rules", "TIC", "--sweep-group-sizes", "2", "3", "4", "--max-tokens", "1", "--prompts", "2",
            "--candidates", "2", "--draws", "30", "--batches", "3"]  # fmt: skip
    run(argv)
    checkpoint = tmp_path / "policies" / "checkpoints" / "update-1.ckpt"
    assert checkpoint.is_file() and (tmp_path / "policies" / "fit_command.json").is_file()
    data = json.loads((tmp_path / "lab.json").read_text())
    by = {(c["rule"], c["group_size"], c["delay"]): c for c in data["cells"]}
    assert set(by) == {("IS", 2, 0), ("GMC", 2, 0), ("IS", 2, 1), ("GMC", 2, 1), ("TIC", 2, 1), ("TIC", 3, 1),
                       ("TIC", 4, 1)}  # fmt: skip
    assert by[("IS", 2, 1)]["exact"]["relative_bias"] < 1e-4  # float32 model, every response kept but 1e-5 of mass
    assert data["delays"][1]["kl_behavior_current"] > 0 == data["delays"][0]["kl_behavior_current"]
    assert set(data["meta"]["phases"]) == {"policies", "prompts", "delay 0", "delay 1"}
    written = checkpoint.stat().st_mtime_ns
    run(argv)
    assert checkpoint.stat().st_mtime_ns == written  # reused, not trained again
    assert capsys.readouterr().out.count("estimator lab:") == 2


def test_estimate_samples_where_the_space_is_too_large_to_enumerate(two_folders, tmp_path):
    folders = ["--behavior", str(two_folders / "behavior"), "--current", str(two_folders / "current"), "--delay", "3"]
    small = ["--rules", "IS", "GMC", "--group-sizes", "2", "--sweep-rules", "--prompts", "1", "--candidates", "2",
             "--draws", "40", "--batches", "4", "--max-tokens", "4"]  # fmt: skip
    with pytest.raises(UserError, match="--max-tokens 4: a vocabulary of 46 tokens gives 4,193,821 responses"):
        run(["estimate", *folders, *small, "--out", str(tmp_path / "enumerated")])
    run(["estimate", *folders, *small, "--space", "sampled", "--out", str(tmp_path / "sampled")])
    data = json.loads((tmp_path / "sampled" / "lab.json").read_text())
    assert data["delays"][0]["space"] == "sampled" and data["delays"][0]["prompts"][0]["max_tokens"] == 4
    assert {c["rule"] for c in data["cells"]} == {"IS", "GMC"} and all(c["exact"] is None for c in data["cells"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--behavior", "tiny"], "--behavior and --current go together"),
        (["--delays", "-1", "4"], "--delays/--delay must be >= 0"),
        (["--draws", "2", "--batches", "5"], "--draws 2 must be at least --batches 5"),
        (["--group-sizes", "1"], "group sizes must be >= 2"),
        (["--rules", "NoSuchRule"], "--rules NoSuchRule: not a registered rule"),
    ],
)
def test_bad_options_get_one_message(argv, message):
    with pytest.raises(UserError, match=message):
        run(["estimate", *argv])


def test_policies_of_different_models_or_a_negative_delay_are_refused(two_folders, tmp_path, char_tokenizer):
    from conftest import make_tiny_model

    other = make_tiny_model(char_tokenizer, hidden=32)
    other.save_pretrained(tmp_path / "other")
    char_tokenizer.save_pretrained(tmp_path / "other")
    with pytest.raises(UserError, match="are not the same model: hidden_size 16 and 32"):
        run(["estimate", "--behavior", str(two_folders / "behavior"), "--current", str(tmp_path / "other"),
             "--delay", "2", "--out", str(tmp_path / "x")])  # fmt: skip
    with pytest.raises(UserError, match="--delay: the delay between"):
        run(["estimate", "--behavior", str(two_folders / "behavior"), "--current", str(two_folders / "current"),
             "--out", str(tmp_path / "x")])  # fmt: skip
    with pytest.raises(UserError, match="--delays/--delay must be >= 0"):
        run(["estimate", "--behavior", str(two_folders / "behavior"), "--current", str(two_folders / "current"),
             "--delay", "-2"])  # fmt: skip
