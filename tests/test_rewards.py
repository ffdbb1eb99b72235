import os
import pickle
import re
import subprocess
import sys
import threading
import time
import warnings

import pytest

from lit_gmc.data.tasks import verifier as rewards
from lit_gmc.data.tasks.addition import Addition
from lit_gmc.data.tasks.reward import Reward
from lit_gmc.data.tasks.verifier import MathVerifier
from lit_gmc.errors import UserError


@pytest.fixture(scope="module")
def verifier():
    v = MathVerifier(num_workers=2, timeout_s=4.0)
    yield v
    v.close()


@pytest.mark.parametrize(
    ("response", "reference", "expected"),
    [
        ("so $x = \\boxed{\\frac12}$", "\\frac{1}{2}", 1.0),
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("\\boxed{(x+2)(x+5)}", "x^2+7x+10", 1.0),
        ("\\boxed{84, 69}", "69,84", 1.0),  # list answers compare as sets
        ("\\boxed{27.0}", "27", 1.0),
        ("\\boxed{2125}", "2,125", 1.0),
        ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "(3,\\pi/2)", 1.0),
        ("\\boxed{1} first, then \\boxed{2}", "1", 0.0),  # only the last box counts
        ("\\boxed{1/3}", "\\frac{1}{2}", 0.0),
        ("the answer is 1/2", "\\frac{1}{2}", 0.0),  # no box: no reward
        ("\\boxed{}", "", 0.0),  # an empty reference is never matched
    ],
)
def test_rewards_follow_math_verify_on_the_last_box(verifier, response, reference, expected):
    assert verifier.score([response], reference) == [expected]


ADVERSARIAL = {
    "deep braces": "\\boxed{" + "{" * 400 + "1" + "}" * 400 + "}",
    "very deep braces": "\\boxed{" + "{" * 100_000 + "}" * 100_000 + "}",
    "unclosed box": "the answer is \\boxed{5",
    "power tower": "\\boxed{10^{10^{10}}}",
    "taller tower": "\\boxed{9^{9^{9^{9}}}}",
    "huge factorial": "\\boxed{(10^{10})!}",
    "100 kB junk": "".join(chr(32 + (i * 7919) % 95) for i in range(100_000)),
    "junk box": "\\boxed{" + "x^" * 50_000 + "}",
    "short junk box": "\\boxed{" + "".join(chr(32 + (i * 7919) % 95) for i in range(900)).replace("}", "") + "}",
    "sympy chokes": "\\boxed{\\frac{\\sqrt[}{}}\\int_\\infty^{\\left(}}",
    "bad environment": "\\boxed{\\begin{pmatrix} 1 & \\end{array}}",
    "control chars": "\\boxed{\x00\x01\x1b[31m\ud800}",
}


@pytest.mark.parametrize("name", list(ADVERSARIAL))
def test_adversarial_responses_score_zero_without_raising(verifier, name):
    assert verifier.score([ADVERSARIAL[name]], "5") == [0.0]


def test_a_correct_answer_still_scores_after_adversarial_ones(verifier):
    scores = verifier.score([*ADVERSARIAL.values(), "\\boxed{5}"], "5")
    assert scores == [0.0] * len(ADVERSARIAL) + [1.0]


def test_safe_from_many_threads(verifier):
    responses = ["\\boxed{5}", "\\boxed{6}", "\\boxed{10/2}", "none"]
    expected = verifier.score(responses, "5")
    assert expected == [1.0, 0.0, 1.0, 0.0]
    results, errors = [None] * 6, []

    def work(slot):
        try:
            results[slot] = verifier.score(responses, "5")
        except Exception as err:  # noqa: BLE001 - surfaced by the assertion below
            errors.append(err)

    threads = [threading.Thread(target=work, args=(slot,)) for slot in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and results == [expected] * 6


def hangs(reference: str, candidate: str, seconds: int) -> bool:
    """A check stuck where no alarm reaches (a C-level computation): the worker runs it instead of math-verify's."""
    time.sleep(600)
    return True


def dies(reference: str, candidate: str, seconds: int) -> bool:
    """A check whose worker crashes (a segfault in a C extension, the OOM killer)."""
    os._exit(3)


def cannot_start(memory_limit_mb: int) -> None:
    raise ImportError("No module named 'math_verify'")


@pytest.mark.parametrize(("check", "outcome"), [(hangs, "timeout"), (dies, "crash")])
def test_a_stuck_or_dead_worker_is_replaced_and_scores_zero(monkeypatch, check, outcome):
    real_check = rewards._check
    monkeypatch.setattr(rewards, "_check", check)  # pickled by name: the spawned worker imports this module for it
    v = MathVerifier(num_workers=1, timeout_s=1.0)
    try:
        assert v.score(["\\boxed{5}"], "5") == [0.0]
        assert v.stats == {outcome: 1}
        monkeypatch.setattr(rewards, "_check", real_check)
        assert v.score(["\\boxed{5}"], "5") == [1.0]  # a fresh worker in the same pool
        assert v.stats == {outcome: 1, "ok": 1}
    finally:
        v.close()


def test_workers_that_cannot_start_raise(monkeypatch):
    monkeypatch.setattr(rewards, "_start_worker", cannot_start)
    v = MathVerifier(num_workers=1)
    with pytest.raises(RuntimeError, match="math-verify workers did not start"):
        v.score(["\\boxed{1}"], "1")
    assert v.pool is None


def test_options_are_checked():
    with pytest.raises(ValueError, match="num_workers"):
        MathVerifier(num_workers=0)
    with pytest.raises(ValueError, match="timeout_s"):
        MathVerifier(timeout_s=0)


def test_pickles_without_its_processes(verifier):
    verifier.score(["\\boxed{1}"], "1")
    clone = pickle.loads(pickle.dumps(verifier))
    try:
        assert clone.timeout_s == verifier.timeout_s and verifier.pool is not None and clone.pool is None
        assert clone.score(["\\boxed{1}"], "1") == [1.0]
    finally:
        clone.close()


def test_the_reward_module_imports_neither_torch_nor_transformers():
    code = "import sys, lit_gmc.data.tasks.verifier; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def native(completions, answer):
    return [float(c == answer) for c in completions]


def trl_style(prompts, completions, **kwargs):
    # TRL passes per-completion lists by keyword: one per dataset column (here the answer)
    return [float(p.endswith("=") and c == a) for p, c, a in zip(prompts, completions, kwargs["answer"], strict=True)]


def completions_only(completions, **kwargs):
    return [float(c == a) for c, a in zip(completions, kwargs["answer"], strict=True)]


@pytest.mark.parametrize("function", [native, trl_style, completions_only])
def test_native_and_trl_reward_functions_give_the_same_rewards(function):
    reward = Reward(function, "f")
    assert reward(["3", "4", " 3"], "3", "1+2=") == [1.0, 0.0, 0.0]


def test_the_task_s_score_is_the_reward_unless_one_is_given():
    task = Addition(max_operand=3)
    assert Reward.of(None, task)(["3", "x"], "3") == [1.0, 0.0]
    assert Reward.of(native, task).name == f"--data.reward {__name__}.native"


def takes_three(completions, answer, extra):
    return [0.0] * len(completions)


@pytest.mark.parametrize(
    ("returned", "message"),
    [(None, r"returned None for 2 completions; it must return a list of 2 numbers"),
     (1.0, r"returned 1.0 for 2 completions"),
     ([1.0], r"returned 1 values for 2 completions"),
     ([1.0, "yes"], r"returned 'yes' among its rewards")],
)  # fmt: skip
def test_a_bad_return_is_one_message_naming_the_function(returned, message):
    reward = Reward(lambda completions, answer: returned, "--data.reward my.bad_reward")
    convention = re.escape(", called as f(completions, answer), ")
    with pytest.raises(UserError, match=r"^reward --data.reward my.bad_reward" + convention + message):
        reward(["a", "b"], "a")


def test_a_wrong_signature_is_refused_when_the_datamodule_is_built():
    from run_helpers import tiny_data

    with pytest.raises(UserError, match=r"reward --data.reward .*takes_three\(completions, answer, extra\) takes "
                                        r"neither \(completions, answer\) nor TRL's keywords"):  # fmt: skip
        tiny_data(reward=takes_three)


def test_any_finite_reward_is_used_as_it_is_without_a_warning():
    """Rewards need not lie in [0, 1] (``Task.score`` says why; ``test_baselines.py`` checks every rule's gradient
    under a shift and a scale of the rewards): TRL's own soft overlong punishment, for one, is negative."""
    reward = Reward(lambda completions, answer: [5.0, -1.0, -1e3, 0.25], "wide")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert reward(["a", "b", "c", "d"], "a") == [5.0, -1.0, -1e3, 0.25]
    assert caught == []
