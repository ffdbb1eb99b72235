"""The learner's autograd gradient equals each estimator written out per sample, on a tiny Qwen3 in float64.

The learner path is the real one (left-padded batch, chunked LM head under checkpointing, micro-batches of
whole groups, the registered rule, the batch-wide normaliser); the reference path runs one plain forward per
unpadded sequence and one backward per sample, then forms the paper's sum by hand.
"""

from __future__ import annotations

import math

import pytest
import torch

from lit_gmc.batch import RolloutGroup, collate_groups
from lit_gmc.module import GMCModule
from lit_gmc.rules import GMC, GRPO, IS, TIC

T_MAX = 7  # the paper's normaliser T (max completion length)
EPS = 0.28


def make_batch(tokenizer, seed: int):
    """2 groups x 4 responses of random tokens, ragged prompts and responses, behaviour log-probs set so that
    one group's mean ratio exceeds 1 + eps (GMC rescales it) and some trajectories exceed the TIC cap."""
    gen = torch.Generator().manual_seed(seed)
    vocab_lo, vocab_hi = 3, len(tokenizer)
    groups = []
    for b, prompt_len in enumerate((3, 5)):
        lengths = torch.randint(2, T_MAX + 1, (4,), generator=gen)
        width = int(lengths.max())
        ids = torch.randint(vocab_lo, vocab_hi, (4, width), generator=gen)
        mask = torch.arange(width)[None, :] < lengths[:, None]
        shift = torch.tensor([-0.9, 0.4, -0.2, 0.1]) if b == 0 else torch.tensor([0.05, -0.02, 0.03, 0.0])
        behavior = (
            -math.log(vocab_hi) + shift[:, None] + 0.05 * torch.randn(4, width, generator=gen)
        ).masked_fill(~mask, 0.0)
        groups.append(RolloutGroup(
            prompt_id=b, prompt="", answer="",
            prompt_ids=torch.randint(vocab_lo, vocab_hi, (prompt_len,), generator=gen),
            response_ids=ids.masked_fill(~mask, tokenizer.pad_token_id), response_mask=mask,
            behavior_logprobs=behavior, finish_reasons=["stop"] * 4,
            rewards=torch.tensor([1.0, 0.0, 1.0, 0.0]) if b == 0 else torch.tensor([0.0, 0.0, 1.0, 0.0]), version=0,
        ))  # fmt: skip
    return groups, collate_groups(groups, pad_id=tokenizer.pad_token_id)


def per_sample(model, batch):
    """Sequence log-prob s_i of every response and its gradient, one backward per sample (and per token).

    The forward is a plain full-logits pass (no chunking, no checkpointing) over one group at a time.
    """
    params = list(model.parameters())
    rows = []
    for b in range(batch.num_groups):
        part = batch.groups_slice(b, b + 1)
        p = part.prompt_width
        logits = model(input_ids=part.input_ids, attention_mask=part.attention_mask.long(),
                       position_ids=part.position_ids).logits  # fmt: skip
        token_lp = torch.log_softmax(logits[:, p - 1 : -1].double(), -1).gather(-1, part.input_ids[:, p:, None])[..., 0]
        for i in range(batch.group_size):
            n = int(part.response_mask[i].sum())
            lp = token_lp[i, :n]
            rows.append({
                "s": float(lp.detach().sum()), "lp": lp.detach(),
                "grad": torch.autograd.grad(lp.sum(), params, retain_graph=True),
                "token_grads": [torch.autograd.grad(lp[t], params, retain_graph=True) for t in range(n)],
                "behavior": part.behavior_logprobs[i, :n].double(), "reward": float(part.rewards[i]),
            })  # fmt: skip
    return rows


def leave_one_out(rewards):
    g = len(rewards)
    return [r - (sum(rewards) - r) / (g - 1) for r in rewards]


def coefficients(rule: str, log_rho: list[float]) -> list[float]:
    rho = [math.exp(x) for x in log_rho]
    if rule == "gmc":  # eq. 9: rho_i / max(1, rho_bar / (1 + eps))
        factor = max(1.0, sum(rho) / len(rho) / (1 + EPS))
        return [r / factor for r in rho]
    if rule == "tic":  # eq. 35: rho_i 1{rho_i <= 1 + eps}
        return [r if r <= 1 + EPS else 0.0 for r in rho]
    return rho  # eq. 2


def direct_gradient(rule: str, rows, group_size: int = 4):
    """g = (1/(T B G)) sum_b sum_i c_i A_i grad log pi(y_i) (eq. 4 with the rule's c_i)."""
    total = None
    n_rows = len(rows)
    for b in range(0, n_rows, group_size):
        group = rows[b : b + group_size]
        coef = coefficients(rule, [r["s"] - float(r["behavior"].sum()) for r in group])
        adv = leave_one_out([r["reward"] for r in group])
        for r, c, a in zip(group, coef, adv, strict=True):
            term = [c * a * gr / (T_MAX * n_rows) for gr in r["grad"]]
            total = term if total is None else [x + y for x, y in zip(total, term, strict=True)]
    return total


def direct_grpo_gradient(rows, group_size: int = 4, eps: float = 0.2):
    """Gradient of (1/N) sum_i (1/|y_i|) sum_t min(r_t A_i, clip(r_t) A_i), r_t = pi/pi_b, per token."""
    total = None
    n_rows = len(rows)
    for b in range(0, n_rows, group_size):
        group = rows[b : b + group_size]
        rewards = [r["reward"] for r in group]
        mean = sum(rewards) / len(rewards)
        for r in group:
            a = r["reward"] - mean
            n = r["lp"].numel()
            for t in range(n):
                ratio = math.exp(float(r["lp"][t] - r["behavior"][t]))
                clipped_side = (a > 0 and ratio > 1 + eps) or (a < 0 and ratio < 1 - eps)
                if clipped_side:
                    continue
                term = [ratio * a * gr / (n * n_rows) for gr in r["token_grads"][t]]
                total = term if total is None else [x + y for x, y in zip(total, term, strict=True)]
    return total


def learner_gradient(module: GMCModule, batch):
    module.actor.zero_grad(set_to_none=True)
    for start in range(batch.num_groups):
        loss, *_ = module.micro_batch_loss(batch, batch.groups_slice(start, start + 1))
        loss.backward()
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in module.actor.parameters()]


def relative_error(a, b) -> float:
    flat_a = torch.cat([x.flatten() for x in a])
    flat_b = torch.cat([x.flatten() for x in b])
    return float((flat_a - flat_b).norm() / flat_b.norm())


@pytest.mark.parametrize("rule", ["gmc", "tic", "is", "grpo"])
def test_autograd_gradient_equals_the_estimator(rule, tiny_actor_dir, char_tokenizer, float64_rmsnorm):
    correction = {"gmc": GMC(cap=EPS), "tic": TIC(cap=EPS), "is": IS(), "grpo": GRPO(clip=0.2)}[rule]
    module = GMCModule(actor=str(tiny_actor_dir), correction=correction, dtype="float64", max_response_length=T_MAX,
                       micro_batch_groups=1, logit_chunk_tokens=3)  # fmt: skip
    _, batch = make_batch(char_tokenizer, seed=3)
    rows = per_sample(module.actor, batch)
    if rule == "gmc":  # the batch must exercise the cap: group 0 rescaled, group 1 not
        rho_bar = [sum(math.exp(r["s"] - float(r["behavior"].sum())) for r in rows[b : b + 4]) / 4 for b in (0, 4)]
        assert rho_bar[0] > 1 + EPS > rho_bar[1]
    expected = direct_grpo_gradient(rows) if rule == "grpo" else direct_gradient(rule, rows)
    got = learner_gradient(module, batch)
    assert relative_error([-g for g in got], expected) < 1e-10


def test_padded_chunked_logprobs_match_an_unpadded_forward(tiny_actor_dir, char_tokenizer):
    """The learner's layout (left-padded prompt, right-padded response, chunked head) changes nothing but
    float32 rounding inside RMSNorm."""
    from lit_gmc.logprobs import response_logprobs

    module = GMCModule(actor=str(tiny_actor_dir), dtype="float64", max_response_length=T_MAX)
    groups, batch = make_batch(char_tokenizer, seed=4)
    with torch.no_grad():
        got, _ = response_logprobs(module.actor, batch.input_ids, batch.attention_mask, batch.prompt_width,
                                   chunk_tokens=2)  # fmt: skip
        row = 0
        for group in groups:
            for i in range(group.group_size):
                n = int(group.response_mask[i].sum())
                full = torch.cat([group.prompt_ids, group.response_ids[i, :n]])[None]
                p = group.prompt_ids.numel()
                lp = torch.log_softmax(module.actor(input_ids=full).logits[0, p - 1 : p - 1 + n], -1)
                expected = lp.gather(-1, group.response_ids[i, :n, None])[:, 0]
                torch.testing.assert_close(got[row, :n], expected, atol=1e-6, rtol=0)
                row += 1
