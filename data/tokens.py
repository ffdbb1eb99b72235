"""Prompts to token ids and responses to text, for the few dozen short rows of a launch.

At these sizes the tokenizer's own calls cost more than the tokenizing. ``tokenizer(texts)`` hands a batch to the
``tokenizers`` library's thread pool, whose threads spend more CPU starting and waiting than encoding, and
``tokenizer.batch_decode`` runs ~5 us of ``transformers`` Python around each row's backend call. On the tiny job
(8 prompts, 64 responses of <= 6 tokens) that was ~0.38 ms of process CPU to encode and ~0.39 ms to decode a launch,
against ~0.1 ms each row by row on the backend (``scripts/bench_parts.py``).

So :func:`encode_prompts` and :func:`decode_responses` call the fast tokenizer's backend (a ``tokenizers.Tokenizer``)
one row at a time, but only where ``transformers`` itself would make exactly that call and change nothing after it:
the tokenizer's class overrides none of the methods on the way, the backend pads and truncates nothing, special
tokens are split as the tokenizer says, and decoding cleans up no spaces. Otherwise, e.g. for a slow tokenizer,
they use the tokenizer's own call. Either way the ids and texts are the ones ``tokenizer(...)`` and
``tokenizer.batch_decode(...)`` give (``tests/test_tokens.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def encode_prompts(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text, without special tokens: ``tokenizer(texts, add_special_tokens=False)["input_ids"]``."""
    backend = _exact_backend(tokenizer, decoding=False)
    if backend is None:
        return tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    return [backend.encode(text, add_special_tokens=False).ids for text in texts]


def decode_responses(tokenizer: Any, rows: Sequence[Sequence[int]]) -> list[str]:
    """Text of each row of ids, special tokens skipped: ``tokenizer.batch_decode(rows, skip_special_tokens=True)``."""
    backend = _exact_backend(tokenizer, decoding=True)
    if backend is None:
        return tokenizer.batch_decode(rows, skip_special_tokens=True)
    return [backend.decode(row, skip_special_tokens=True) for row in rows]


def _exact_backend(tokenizer: Any, decoding: bool) -> Any:
    """The backend whose one-row call gives exactly the tokenizer's own result, or None.

    The conditions are read off ``transformers``' ``TokenizersBackend``: its ``_encode_plus`` first switches the
    backend's padding and truncation off and sets ``encode_special_tokens`` to ``split_special_tokens``, then
    returns each encoding's ids; its ``_decode`` returns the backend's text unless ``clean_up_tokenization_spaces``.
    """
    from transformers import PreTrainedTokenizerBase
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    if not isinstance(tokenizer, TokenizersBackend):
        return None
    cls, backend = type(tokenizer), tokenizer.backend_tokenizer
    if decoding:
        same_path = (
            cls.batch_decode is PreTrainedTokenizerBase.batch_decode
            and cls.decode is PreTrainedTokenizerBase.decode
            and cls._decode is TokenizersBackend._decode
        )
        return backend if same_path and not tokenizer.clean_up_tokenization_spaces else None
    same_path = (
        cls.__call__ is PreTrainedTokenizerBase.__call__
        and cls._encode_plus is TokenizersBackend._encode_plus
        and not hasattr(tokenizer, "_switch_to_input_mode")
    )
    same_state = (
        backend.padding is None
        and backend.truncation is None
        and backend.encode_special_tokens == bool(tokenizer.split_special_tokens)
    )
    return backend if same_path and same_state else None
