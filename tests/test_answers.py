import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_gmc.data.tasks.answers import gsm8k_final_answer, last_boxed, reference_text, strip_dollars


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so $x = \\boxed{7}$.", "7"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{ 8+4i }", "8+4i"),  # stripped
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # escaped set braces do not close the box
        ("first \\boxed{1} then \\boxed{2}", "2"),
        ("\\boxed{5} and a truncated \\boxed{1", "5"),  # the last *complete* box
        ("our answer is $\\boxed 2$.", None),  # no braces: not a complete box (2 MATH solutions do this)
        ("there are $\\boxed{}$ primes", ""),  # closed but empty: extractable, empty answer
        ("\\boxed {x+1}", "x+1"),  # spaces before the brace are allowed
        ("\\boxedfoo{1}", None),  # another command
        ("\\boxed{\\boxed{1}+1}", "\\boxed{1}+1"),  # nested boxes: the one that closes last (outer)
        ("\\boxed{a \\\\ {b}}", "a \\\\ {b}"),  # \\ is a line break, the brace after it counts
        ("} } \\boxed{3} }", "3"),  # stray closers are ignored
        ("{ \\boxed{4}", "4"),  # an unclosed group before the box does not matter
        ("no box at all", None),
        ("", None),
        ("\\boxed{", None),
        ("trailing backslash \\", None),
    ],
)
def test_last_boxed_cases(text, expected):
    assert last_boxed(text) == expected


def test_last_boxed_survives_adversarial_text():
    deep = "\\boxed{" + "{" * 100_000 + "1" + "}" * 100_000 + "}"
    assert last_boxed(deep) == "{" * 100_000 + "1" + "}" * 100_000
    assert last_boxed("\\boxed{" * 20_000) is None  # 20k unclosed boxes, one pass
    junk = "".join(chr(32 + (i * 7919) % 95) for i in range(100_000))  # 100 kB of ASCII junk, braces included
    assert junk.count("{") > 1000 and junk.count("\\") > 1000
    assert last_boxed(junk + "\\boxed{42}") == "42"  # the junk's open groups and escapes cannot swallow the box
    assert last_boxed("\\boxed{" + "x^" * 50_000 + "}") == "x^" * 50_000


_plain = st.text(alphabet=st.characters(blacklist_characters="\\{}", blacklist_categories=("Cs",)), max_size=40)


@settings(max_examples=200, deadline=None)
@given(prefix=_plain, inner=_plain, suffix=_plain, groups=st.integers(0, 3))
def test_last_boxed_finds_a_trailing_box(prefix, inner, suffix, groups):
    content = "{" * groups + inner + "}" * groups
    assert last_boxed(prefix + "\\boxed{" + content + "}" + suffix) == content.strip()


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="\\{}boxed 12", max_size=60))
def test_last_boxed_never_raises_and_returns_a_substring(text):
    result = last_boxed(text)
    assert result is None or result in text


def naive_last_box(solution: str) -> str | None:
    """Direct reading of the rule: find the last '\\boxed{' and count braces forward to its match."""
    start = solution.rfind("\\boxed{")
    if start == -1:
        return None
    depth, i = 0, start + len("\\boxed")
    while i < len(solution):
        if solution[i] == "\\":
            i += 2
            continue
        depth += {"{": 1, "}": -1}.get(solution[i], 0)
        if depth == 0:
            return solution[start + len("\\boxed{") : i].strip()
        i += 1
    return None


def test_matches_the_naive_rule_and_the_file_on_every_math_solution(shared_data):
    rows = [json.loads(line) for line in (shared_data / "math_train.jsonl").open()]
    ours = [last_boxed(r["solution"]) for r in rows]
    assert ours == [naive_last_box(r["solution"]) for r in rows]
    extracted = [(o, r) for o, r in zip(ours, rows, strict=True) if o is not None]
    assert len(extracted) == 7498
    # The file's precomputed answers agree (up to surrounding spaces) wherever a braced box exists.
    assert all(o == r["answer"].strip() for o, r in extracted)
    missing = [r["solution"][-40:] for o, r in zip(ours, rows, strict=True) if o is None]
    assert all("\\boxed " in tail for tail in missing) and len(missing) == 2


@pytest.mark.parametrize(
    ("rationale", "expected"),
    [
        ("She makes 9 * 2 = $<<9*2=18>>18.\n#### 18", "18"),
        ("... #### 1,450,000", "1450000"),
        ("#### -3", "-3"),
        ("#### 2,125\n", "2125"),
        ("#### 1 #### 2", "2"),  # the last marker
        ("no marker 5", None),
        ("#### ", None),
    ],
)
def test_gsm8k_final_answer(rationale, expected):
    assert gsm8k_final_answer(rationale) == expected


def test_strip_dollars_keeps_escaped_dollars():
    assert strip_dollars("$48$, $384$") == "48, 384"
    assert strip_dollars("\\$18.90") == "\\$18.90"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("$\\frac{\\pi}{3}$", "\\frac{\\pi}{3}"),
        (27.0, "27"),
        (-1.0, "-1"),
        (0.5, "0.5"),
        (3, "3"),
        (["$69$,$84$"], "69,84"),
        (["2", "3"], "2, 3"),
    ],
)
def test_reference_text(value, expected):
    assert reference_text(value) == expected


@pytest.mark.parametrize("value", [True, math.nan, math.inf, [], [1, 2], None, {"a": 1}])
def test_reference_text_rejects_other_types(value):
    with pytest.raises(ValueError, match="reference answer"):
        reference_text(value)
