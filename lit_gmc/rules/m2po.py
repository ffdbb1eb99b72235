"""M2PO (Zheng et al. 2025, "Prosperity before Collapse", arXiv 2510.01161): second-moment token masking."""

from __future__ import annotations

from torch import Tensor
from typing_extensions import override

from lit_gmc import objectives as O
from lit_gmc.corrections import PolicyTerms
from lit_gmc.rules._token_level import TokenLevel


class M2PO(TokenLevel):
    """M2PO: ``-sg(M_t r_t A_i) log pi_theta(y_t)``, ``M`` dropping the tokens of largest ``(log r_t)^2`` first.

    ``M`` (:func:`~lit_gmc.objectives.m2po_keep_mask`, the paper's Algorithm 1 over every real token, as AReaL):
    tokens are dropped, largest ``(log r)^2`` first, until the mean ``(log r)^2`` of the rest is at most
    ``m2_threshold``; the kept tokens get the plain ratio ``r_t = pi_theta / pi_b`` (no clip), and ``token_mean``
    divides by every real token (the paper's ``1 / sum_i |o_i|``). The mask is taken over the tokens of one call,
    a micro-batch (as AReaL and the authors' code): set ``--model.micro_batch_groups`` to at least
    ``--data.batch_prompts`` for the whole update's. ``m2po/masked_fraction``, and the second moment
    ``mean (log r)^2`` before (``m2po/m2``) and after (``m2po/m2_kept``) the mask.

    Args:
        m2_threshold: ``tau_M2``, the bound on the kept tokens' mean ``(log r)^2`` (the paper's 0.04).
        aggregation: Loss aggregation; ``null``: the paper's ``token_mean``.
    """

    threshold_option = "m2_threshold"
    default_aggregation = "token_mean"
    couples_groups = True  # the mask is over every token of the call

    def __init__(self, m2_threshold: float = 0.04, aggregation: O.Aggregation | None = None) -> None:
        super().__init__(aggregation, m2_threshold=m2_threshold)

    @override
    def token_loss(self, terms: PolicyTerms, coefficients: Tensor, advantages: Tensor) -> tuple[Tensor, dict]:
        """The masked token ratios as weights; the masked share and the second moment before and after."""
        mask = terms.mask
        log_r = O.token_log_ratio(terms.token_logprobs, terms.behavior_logprobs, mask)  # (n, L)
        keep = O.m2po_keep_mask(log_r, mask, self.m2_threshold)  # (n, L)
        weights = O.kept_ratio(log_r, keep)  # (n, L)
        loss = O.token_policy_gradient_loss(weights, advantages, terms.token_logprobs, mask)  # (n, L)
        second = log_r.square()  # (n, L), 0 on padding
        extra = {
            "m2po/masked_fraction": O.token_fraction(mask & ~keep, mask),
            "m2po/m2": second.sum() / mask.sum().clamp(min=1),
            "m2po/m2_kept": second.masked_fill(~keep, 0.0).sum() / keep.sum().clamp(min=1),
        }
        return loss, extra

