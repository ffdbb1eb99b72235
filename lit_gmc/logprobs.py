"""Token log-probs and entropies of response tokens without materialising full-vocabulary logits at once.

The backbone runs on a micro-batch; the LM head and log-softmax run on chunks of response positions, each under
activation checkpointing when there are several, so that autograd keeps a chunk's hidden states, not its
``(rows, chunk, V)`` logits (at Qwen3's vocabulary, 2.5 GB per 8 x 512 positions). A single chunk is not
checkpointed: its logits are alive in its backward anyway, so that would only run the head twice.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lit_gmc.objectives import token_entropy


def _head_logprobs(head: nn.Module, hidden: Tensor, targets: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """Log-prob of ``targets`` and entropy under ``softmax(head(hidden) / temperature)``; ``(n, c)`` each."""
    logits = head(hidden)  # (n, c, V)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if temperature != 1.0:  # x / 1.0 is x: skip a pass over (n, c, V)
        logits = logits / temperature
    logprobs = torch.log_softmax(logits, dim=-1)  # (n, c, V)
    logp = logprobs.gather(-1, targets[..., None]).squeeze(-1)  # (n, c)
    with torch.no_grad():
        entropy = token_entropy(logprobs)  # (n, c)
    return logp, entropy


def response_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    prompt_width: int,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = 512,
) -> tuple[Tensor, Tensor]:
    """Log-probs and entropies of the response tokens of rows laid out as ``[left-padded prompt | response]``.

    Args:
        model: A transformers causal LM (``base_model`` backbone plus ``get_output_embeddings()`` head).
        input_ids: ``(n, P + L)`` token ids.
        attention_mask: ``(n, P + L)`` True on real tokens.
        prompt_width: ``P``; response token ``t`` sits at ``P + t`` and is predicted at ``P - 1 + t``.
        temperature: Sampling temperature the behaviour policy used; logits are divided by it.
        chunk_tokens: Response positions per LM-head chunk.

    Returns:
        ``(token_logprobs, entropy)``, both ``(n, L)``; entropy is detached. Padding positions hold
        finite junk and must be masked by the caller.
    """
    if input_ids.shape != attention_mask.shape or input_ids.dim() != 2:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} must match"
        )
    if not 0 < prompt_width < input_ids.shape[1]:
        raise ValueError(f"prompt_width={prompt_width} must lie inside the row width {input_ids.shape[1]}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # (n, P + L)
    backbone = model.base_model
    hidden = backbone(
        input_ids=input_ids, attention_mask=attention_mask.long(), position_ids=position_ids, use_cache=False
    ).last_hidden_state  # (n, P + L, H)
    hidden = hidden[:, prompt_width - 1 : -1]  # (n, L, H): the positions that predict response tokens
    targets = input_ids[:, prompt_width:]  # (n, L)
    head = model.get_output_embeddings()
    logps, entropies = [], []
    starts = range(0, targets.shape[1], chunk_tokens)
    for start in starts:
        h, y = hidden[:, start : start + chunk_tokens], targets[:, start : start + chunk_tokens]
        if len(starts) > 1 and torch.is_grad_enabled() and h.requires_grad:
            # No RNG state to preserve (the head is deterministic), and restoring it would reset the global
            # generator under a rollout thread sampling from it at the same time.
            logp, ent = checkpoint(
                _head_logprobs, head, h, y, temperature, use_reentrant=False, preserve_rng_state=False
            )
        else:
            logp, ent = _head_logprobs(head, h, y, temperature)
        logps.append(logp)
        entropies.append(ent)
    return torch.cat(logps, dim=1), torch.cat(entropies, dim=1)  # (n, L), (n, L)
