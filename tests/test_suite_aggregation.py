"""The paper's suites hold the loss aggregation fixed across methods: 1/(T B G) (Eq. 2) for every rule.

For the rules whose authors aggregate otherwise (GRPO and GAC: seq-mean-token-mean; A-3PO: token-mean), the loss
and its gradient are checked in float64 against the per-token equation written out in plain Python, in both
aggregations; and the Qwen3 config is checked to give every rule the paper's aggregation, each rule's own one
option away.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_cli import REPO, parse

from lit_gmc import objectives as O
from lit_gmc.corrections import PolicyTerms
from lit_gmc.rules import A3PO, GAC, GRPO

G, N, L, T = 3, 6, 5, 8  # T, the configured maximum completion length, exceeds every row's length on purpose
CLIP = 0.2
AUTHORS = {"grpo": "seq_mean_token_mean", "gac": "seq_mean_token_mean", "a3po": "token_mean"}
RULES = {"grpo": GRPO, "gac": GAC, "a3po": A3PO}


def inputs(seed: int):
    """Ragged rows, behaviour log-probs off by up to +-0.6 a token (so both sides of the clip occur), mixed delays."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [5, 2, 4, 1, 3, 5]
    mask = torch.tensor([[t < n for t in range(L)] for n in lengths])
    current = (-torch.rand(N, L, generator=gen, dtype=torch.float64) * 3).masked_fill(~mask, 0.0)
    behavior = (current + (torch.rand(N, L, generator=gen, dtype=torch.float64) - 0.5) * 1.2).masked_fill(~mask, 0.0)
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.2, 0.9, 0.0], dtype=torch.float64)
    delays = torch.tensor([0, 0, 0, 4, 4, 4])
    return current.requires_grad_(), behavior, mask, rewards, delays


def written_out(name: str, aggregation: str, current, behavior, mask, rewards, delays) -> tuple[float, list]:
    """The loss and d loss / d log pi_theta(y_it), token by token, from the equations (no tensor ops)."""
    lp, lb = current.detach().tolist(), behavior.tolist()
    lengths = [int(m.sum()) for m in mask]
    total_tokens = sum(lengths)
    loss, grad = 0.0, [[0.0] * L for _ in range(N)]
    for i in range(N):
        group = [float(r) for r in rewards[(i // G) * G : (i // G + 1) * G]]
        adv = float(rewards[i]) - sum(group) / G  # r_i - mean(r), the centred advantage of all three
        alpha = 1.0 / max(1, int(delays[i])) if name == "a3po" else 1.0  # GRPO / GAC: the proximal policy is l
        for t in range(lengths[i]):
            d = lp[i][t] - lb[i][t]
            ratio = math.exp(alpha * d)  # pi_theta / pi_prox, with log pi_prox = alpha l + (1 - alpha) log pi_theta
            outer = math.exp((1 - alpha) * d)  # pi_prox / pi_b: 1 for GRPO and GAC, unclipped for A-3PO
            clipped = min(max(ratio, 1 - CLIP), 1 + CLIP)
            token = -outer * min(ratio * adv, clipped * adv)
            slope = -outer * ratio * adv if ratio * adv <= clipped * adv else 0.0  # the clipped branch is constant
            if aggregation == "seq_sum_over_T":
                scale = 1.0 / (T * N)
            elif aggregation == "seq_mean_token_mean":
                scale = 1.0 / (N * lengths[i])
            else:  # token_mean
                scale = 1.0 / total_tokens
            loss += scale * token
            grad[i][t] = scale * slope
    return loss, grad


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("paper", [True, False], ids=["paper_1_over_TBG", "authors"])
@pytest.mark.parametrize("name", list(RULES))
def test_loss_and_gradient_equal_the_per_token_equation(name, paper, seed):
    rule = RULES[name](aggregation="seq_sum_over_T") if paper else RULES[name]()
    assert rule.aggregation == ("seq_sum_over_T" if paper else AUTHORS[name])
    current, behavior, mask, rewards, delays = inputs(seed)
    out = rule(PolicyTerms(current, behavior, mask, rewards, delays, G))
    loss = O.aggregate_loss(out.token_loss, mask, rule.aggregation, max_length=T, total_sequences=N,
                            total_tokens=int(mask.sum()))  # fmt: skip
    (grad,) = torch.autograd.grad(loss, current)
    want_loss, want_grad = written_out(name, rule.aggregation, current, behavior, mask, rewards, delays)
    assert float(loss.detach()) == pytest.approx(want_loss, rel=1e-12, abs=1e-15)
    torch.testing.assert_close(grad, torch.tensor(want_grad, dtype=torch.float64), rtol=1e-12, atol=1e-15)
    assert 0 < int((grad == 0)[mask].sum()) < int(mask.sum())  # both branches of the clip occur


def test_the_two_aggregations_differ_on_these_inputs():
    """Otherwise the test above could not tell them apart."""
    current, behavior, mask, rewards, delays = inputs(0)
    values = {
        mode: float(O.aggregate_loss(GRPO()(PolicyTerms(current, behavior, mask, rewards, delays, G)).token_loss, mask,
                                     mode, max_length=T, total_sequences=N, total_tokens=int(mask.sum())))
        for mode in ("seq_sum_over_T", "seq_mean_token_mean", "token_mean")
    }  # fmt: skip
    assert len({round(v, 12) for v in values.values()}) == 3


@pytest.mark.parametrize("rule", ["GRPO", "GAC", "A3PO", "VCPO", "TIC", "GMC"])
def test_the_qwen3_suites_give_every_rule_the_papers_aggregation(rule):
    config = ["--config", str(REPO / "configs" / "qwen3_4b.yaml"), "--model.correction", rule]
    assert parse(*config).model.correction.init_args.aggregation == "seq_sum_over_T"
    own = parse(*config, "--model.correction.aggregation", "null").model.correction.init_args.aggregation
    assert own is None  # null: the rule's constructor takes its authors' aggregation
