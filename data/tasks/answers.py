r"""Final-answer extraction: the last complete ``\boxed{...}`` of a text, GSM8K's ``#### n`` line, references.

Pure string functions, linear in the text and never raising on any ``str`` (model output can be anything). Labels
and responses are read by the same rule.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

_GSM8K_MARK = "####"
_DIGIT_GROUP_COMMA = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_UNESCAPED_DOLLAR = re.compile(r"(?<!\\)\$")
_BOX_OPENER = re.compile(r"\\boxed[ \t]*\{")
"""``\\boxed{``, spaces allowed before the brace (``\\boxedfoo`` is another command, ``\\boxed 2`` no complete box)."""
PROBLEM_MARK = "Problem:"
"""What starts each problem of the two-shot prompt (:func:`lit_gmc.data.tasks.math_data.build_prompt`)."""


def last_boxed(text: str) -> str | None:
    r"""Content of the last complete ``\boxed{...}`` in ``text``, stripped, or ``None`` if there is none.

    Braces are matched with a stack, ``\{`` and ``\}`` not counting. "Last" is the box that closes last: the outer
    of nested boxes, and an unclosed ``\boxed{`` at the end (a truncated response) is skipped.
    """
    openers = {match.end() - 1 for match in _BOX_OPENER.finditer(text)}  # positions of each box's "{"
    if not openers:
        return None
    stack: list[int] = []  # positions of currently open '{'
    best: tuple[int, int] | None = None  # (open, close) of the box that closed last
    i, n = 0, len(text)
    while i < n:
        char = text[i]
        if char == "\\":
            i += 2  # the escaped character is literal
            continue
        if char == "{":
            stack.append(i)
        elif char == "}" and stack:
            opened = stack.pop()
            if opened in openers:
                best = (opened, i)
        i += 1
    if best is None:
        return None
    return text[best[0] + 1 : best[1]].strip()


def answer_region(completion: str) -> str:
    """The part of a completion before a new ``Problem:`` line (used only with ``cut_at_next_problem``).

    A base model continuing a few-shot prompt often invents the next problem and boxes its answer; the paper
    scores the last box regardless.
    """
    cut = completion.find(f"\n{PROBLEM_MARK}")
    return completion if cut == -1 else completion[:cut]


def gsm8k_final_answer(rationale: str) -> str | None:
    """The number after GSM8K's last ``####``, without thousands separators, or ``None`` if there is none."""
    _, mark, answer = rationale.rpartition(_GSM8K_MARK)
    answer = _DIGIT_GROUP_COMMA.sub("", answer.strip())
    return answer if mark and answer else None


def strip_dollars(latex: str) -> str:
    r"""Remove unescaped ``$`` math delimiters (``"$48$, $384$"`` -> ``"48, 384"``); ``\$`` is kept."""
    return _UNESCAPED_DOLLAR.sub("", latex).strip()


def reference_text(value: str | float | int | Sequence[str]) -> str:
    """A benchmark's reference answer as one LaTeX string the verifier can parse.

    Strings lose their ``$`` delimiters; integral floats become integers (AMC23 stores ``27.0``); a list
    (OlympiadBench's ``final_answer``) is joined with ``", "``, which the verifier reads as a set. Anything else, or
    a non-finite number, is a ``ValueError``.
    """
    if isinstance(value, bool):
        raise ValueError(f"reference answer must be text, a number or a list of text, got {value!r}")
    if isinstance(value, str):
        return strip_dollars(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"reference answer must be finite, got {value!r}")
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, Sequence) and value and all(isinstance(v, str) for v in value):
        return ", ".join(strip_dollars(v) for v in value)
    raise ValueError(f"reference answer must be text, a number or a non-empty list of text, got {value!r}")
