"""The responses a prompt can get, their log-probs under a policy, and their per-token score vectors.

A prompt's *space* is every response of at most ``T`` tokens: those that stop at an EOS before ``T`` and those cut at
``T`` (the engines' rule, :func:`~lit_gmc.data.engines.hf.response_lengths`). Over it the policy's probabilities sum
to 1, so expectations are sums, not samples. Log-probs and scores come from one forward per row with no attention
mask: every row of a space shares its prompt (no left padding), and the right padding after an EOS is never attended
to by the tokens before it, so the values are the learner's (:func:`~lit_gmc.logprobs.response_logprobs`, checked in
tests/test_lab.py). Scores are ``torch.func`` Jacobians, vectorised over rows, flattened in ``named_parameters``
order.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lit_gmc.errors import UserError

MAX_ROWS = 100_000
"""Above this many responses a prompt, the space is not enumerated (``--max-tokens`` too high for the vocabulary)."""


@dataclass(frozen=True)
class PromptSpace:
    """Every response of at most ``T`` tokens to one prompt, and its reward.

    Attributes:
        prompt: The prompt's text.
        answer: Its reference answer.
        prompt_ids: ``(P,)`` token ids of the prompt.
        response_ids: ``(N, T)`` token ids, right-padded with the pad id after an EOS.
        mask: ``(N, T)`` True on real response tokens (the EOS included).
        rewards: ``(N,)`` the task's reward of each response (float64).
    """

    prompt: str
    answer: str
    prompt_ids: Tensor
    response_ids: Tensor
    mask: Tensor
    rewards: Tensor

    @property
    def size(self) -> int:
        """``N``, the number of responses."""
        return int(self.response_ids.shape[0])

    @property
    def max_tokens(self) -> int:
        """``T``."""
        return int(self.response_ids.shape[1])

    def rows(self) -> Tensor:
        """``(N, P + T)``: prompt and response of every row."""
        return torch.cat([self.prompt_ids.expand(self.size, -1), self.response_ids], dim=1)


def response_count(vocab_size: int, max_tokens: int) -> int:
    """How many responses of at most ``max_tokens`` tokens a vocabulary of ``vocab_size`` (one EOS) has."""
    others = vocab_size - 1
    return sum(others**k for k in range(max_tokens - 1)) + others ** (max_tokens - 1) * vocab_size


def all_responses(vocab_size: int, eos_id: int, pad_id: int, max_tokens: int) -> tuple[Tensor, Tensor]:
    """``(ids, mask)``, each ``(N, T)``: every response of at most ``T`` tokens, shortest first.

    A response of ``k < T`` tokens is ``k - 1`` non-EOS tokens and an EOS; one of ``T`` tokens is ``T - 1`` non-EOS
    tokens and any last token. ``N`` is :func:`response_count`.
    """
    if max_tokens < 1:
        raise UserError(f"--max-tokens {max_tokens} must be >= 1")
    count = response_count(vocab_size, max_tokens)
    if count > MAX_ROWS:
        raise UserError(f"--max-tokens {max_tokens}: a vocabulary of {vocab_size} tokens gives {count:,} responses a "
                        f"prompt, more than the {MAX_ROWS:,} the lab enumerates; lower --max-tokens, or sample them "
                        "(--space sampled)")  # fmt: skip
    others = torch.tensor([t for t in range(vocab_size) if t != eos_id])
    ids, masks = [], []
    for length in range(1, max_tokens + 1):
        last = torch.arange(vocab_size) if length == max_tokens else torch.tensor([eos_id])
        parts = [others] * (length - 1) + [last]
        body = torch.cartesian_prod(*parts).reshape(-1, length)  # (n_k, length)
        pad = torch.full((body.shape[0], max_tokens - length), pad_id)
        ids.append(torch.cat([body, pad], dim=1))
        masks.append(torch.arange(max_tokens)[None, :].expand(body.shape[0], -1) < length)
    return torch.cat(ids), torch.cat(masks)


def prompt_space(
    prompt: str, answer: str, tokenizer, max_tokens: int, score: Callable[[list[str], str], list[float]]
) -> PromptSpace:
    """The space of ``prompt``'s responses, each scored by ``score(completions, answer)`` on its decoded text.

    Completions are decoded as the DataModule decodes them (special tokens skipped).
    """
    prompt_ids = torch.tensor(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    ids, mask = all_responses(len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id, max_tokens)
    texts = tokenizer.batch_decode([row[m].tolist() for row, m in zip(ids, mask, strict=True)],
                                   skip_special_tokens=True)  # fmt: skip
    return PromptSpace(prompt, answer, prompt_ids, ids, mask, scored(texts, answer, prompt, score))


def scored(texts: list[str], answer: str, prompt: str, score: Callable[[list[str], str], list[float]]) -> Tensor:
    """``(N,)`` float64 rewards of ``texts``; one :class:`UserError` for a wrong count or a non-finite reward."""
    rewards = torch.tensor(score(texts, answer), dtype=torch.float64)
    if rewards.shape != (len(texts),) or not torch.isfinite(rewards).all():
        raise UserError(f"the task's score gave {tuple(rewards.shape)} rewards for {len(texts)} completions of "
                        f"{prompt!r}, or a non-finite one: it must give one finite reward per completion")
    return rewards


def chunks(total: int, size: int) -> Iterator[slice]:
    """Consecutive slices of ``range(total)``, ``size`` long (the last shorter)."""
    for start in range(0, total, size):
        yield slice(start, min(start + size, total))


def _token_logprobs(logits: Tensor, ids: Tensor, prompt_width: int, temperature: float) -> Tensor:
    """``(..., T)`` log-probs of the response tokens of ``ids`` from the logits of the whole rows."""
    head = logits[..., prompt_width - 1 : -1, :]  # the positions that predict response tokens
    head = head.to(torch.promote_types(head.dtype, torch.float32)) / temperature  # as the learner's head
    return torch.log_softmax(head, -1).gather(-1, ids[..., prompt_width:, None])[..., 0]


@torch.no_grad()
def token_logprobs(model: nn.Module, space: PromptSpace, temperature: float = 1.0, chunk_rows: int = 1024) -> Tensor:
    """``(N, T)`` float64 log-probs of every response token of ``space`` under ``model`` (0 on padding)."""
    rows, width = space.rows(), space.prompt_ids.numel()
    out = [
        _token_logprobs(model(input_ids=rows[part], use_cache=False).logits, rows[part], width, temperature)
        for part in chunks(space.size, chunk_rows)
    ]
    return torch.cat(out).double().masked_fill(~space.mask, 0.0)


def prefix_scores(
    model: nn.Module, space: PromptSpace, rows: Tensor, temperature: float = 1.0, chunk: int = 64
) -> tuple[Tensor, Tensor]:
    """Score vectors of the real tokens of ``rows``, each distinct prefix once.

    Token ``t`` of a response has the score ``grad_theta log pi_theta(y_t | x, y_<t)``, which depends on the response
    only through ``y_<=t``: responses that share a first token share its score. Returns ``(scores, prefix)``:
    ``scores`` ``(Q, d)`` of the ``Q`` distinct prefixes (float, the model's dtype), ``prefix`` ``(U,)`` the index
    into them of every real token of ``rows``, in row-major order (``torch.nonzero(space.mask[rows])``'s). ``d`` runs
    over ``model.named_parameters()`` flattened in order (tied weights once).
    """
    from torch.func import functional_call, grad, vmap

    where = torch.nonzero(space.mask[rows])  # (U, 2)
    length = space.max_tokens
    tokens = space.response_ids[rows[where[:, 0]]]  # (U, T)
    keys = tokens.masked_fill(torch.arange(length)[None, :] > where[:, 1:2], -1)  # (U, T): y_<=t, then -1
    keys, prefix = torch.unique(keys, dim=0, return_inverse=True)  # (Q, T), (U,)
    last = (keys >= 0).sum(-1) - 1  # (Q,) the position t of each prefix's own token
    names = [name for name, _ in model.named_parameters()]
    params = {name: p.detach() for name, p in model.named_parameters()}

    def token_logprob(values: dict[str, Tensor], context: Tensor, token: Tensor) -> Tensor:  # ()
        logits = functional_call(model, values, args=(), kwargs={"input_ids": context[None], "use_cache": False})
        head = logits.logits[0, -1]
        head = head.to(torch.promote_types(head.dtype, torch.float32)) / temperature  # as the learner's head
        return torch.log_softmax(head, -1).gather(0, token[None])[0]

    gradient = vmap(grad(token_logprob), in_dims=(None, 0, 0))
    scores = torch.empty(keys.shape[0], sum(p.numel() for p in params.values()),
                         dtype=next(iter(params.values())).dtype)
    with warnings.catch_warnings():  # vmap runs attention's CPU kernel row by row and says so at every call: right
        warnings.filterwarnings("ignore", message="There is a performance drop because we have not yet implemented")
        for t in torch.unique(last).tolist():
            at = (last == t).nonzero()[:, 0]  # prefixes whose own token is y_t: context is the prompt and y_<t
            contexts = torch.cat([space.prompt_ids.expand(at.numel(), -1), keys[at, :t]], dim=1)
            for part in chunks(at.numel(), chunk):
                grads = gradient(params, contexts[part], keys[at[part], t])  # name -> (c, *shape)
                scores[at[part]] = torch.cat([grads[name].flatten(1) for name in names], dim=1)
    return scores, prefix


@torch.no_grad()
def sample_responses(
    model: nn.Module, prompt_ids: Tensor, count: int, max_tokens: int, eos_id: int, pad_id: int,
    generator: torch.Generator, temperature: float = 1.0, chunk: int = 1024,
) -> tuple[Tensor, Tensor]:
    """``(ids, mask)``, each ``(count, T)``: responses drawn token by token from ``softmax(logits / temperature)``.

    A response stops at its first EOS (kept, as the engines keep it) or at ``T`` tokens; the rest is ``pad_id``. The
    distribution is the one :func:`token_logprobs` scores (the same logits, head precision and temperature).
    """
    ids_out, mask_out = [], []
    for part in chunks(count, chunk):
        rows = part.stop - part.start
        ids = torch.full((rows, max_tokens), pad_id, dtype=torch.long)
        mask = torch.zeros(rows, max_tokens, dtype=torch.bool)
        alive = torch.ones(rows, dtype=torch.bool)
        for t in range(max_tokens):
            context = torch.cat([prompt_ids.expand(rows, -1), ids[:, :t]], dim=1)
            head = model(input_ids=context, use_cache=False).logits[:, -1]
            head = head.to(torch.promote_types(head.dtype, torch.float32)) / temperature
            token = torch.multinomial(torch.softmax(head.double(), -1), 1, generator=generator)[:, 0]
            ids[alive, t] = token[alive]
            mask[alive, t] = True
            alive &= token != eos_id
        ids_out.append(ids)
        mask_out.append(mask)
    return torch.cat(ids_out), torch.cat(mask_out)


def sampled_space(
    prompt: str, answer: str, tokenizer, pools: list[tuple[Tensor, Tensor]],
    score: Callable[[list[str], str], list[float]],
) -> tuple[PromptSpace, list[Tensor]]:
    """The distinct responses of sampled ``pools`` as a :class:`PromptSpace`, and each pool's rows in it."""
    ids = torch.cat([pool_ids for pool_ids, _ in pools])
    mask = torch.cat([pool_mask for _, pool_mask in pools])
    unique, inverse = torch.unique(torch.cat([ids, mask.long()], dim=1), dim=0, return_inverse=True)
    length = ids.shape[1]
    space_ids, space_mask = unique[:, :length], unique[:, length:].bool()
    texts = tokenizer.batch_decode([row[m].tolist() for row, m in zip(space_ids, space_mask, strict=True)],
                                   skip_special_tokens=True)  # fmt: skip
    rewards = scored(texts, answer, prompt, score)
    prompt_ids = torch.tensor(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    sizes = [pool_ids.shape[0] for pool_ids, _ in pools]
    return PromptSpace(prompt, answer, prompt_ids, space_ids, space_mask, rewards), list(torch.split(inverse, sizes))
