import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from lit_gmc.data.tasks.answers import answer_region
from lit_gmc.data.tasks.base import Task, truncate_prompt
from lit_gmc.data.tasks.math import Math
from lit_gmc.data.tasks.math_data import (
    INSTRUCTION,
    WORKED_EXAMPLES,
    DataSource,
    build_prompt,
    load_math_train,
    load_records,
    make_prompts,
)
from lit_gmc.data.tasks.verifier import MathVerifier


@pytest.fixture(scope="module")
def math_set(shared_data):
    return load_math_train(str(shared_data / "math_train.jsonl"))


def test_shipped_file_keeps_the_papers_7498_rows(math_set, shared_data):
    rows = [json.loads(line) for line in (shared_data / "math_train.jsonl").open()]
    assert math_set.rows == 7500
    assert math_set.rows - len(math_set.no_answer) == 7498  # rows whose reference answer could be extracted
    assert [rows[i]["unique_id"] for i in math_set.no_answer] and all(
        "\\boxed " in rows[i]["solution"] for i in math_set.no_answer
    )
    assert len(math_set.no_answer) == 2
    # The prompt's two worked examples are training rows, left out of the training prompts.
    assert sorted(rows[i]["unique_id"] for i in math_set.held_out) == sorted(ex.unique_id for ex in WORKED_EXAMPLES)
    assert len(math_set.problems) == 7498 - 2
    shots = {ex.problem for ex in WORKED_EXAMPLES}
    assert not any(p.problem in shots for p in math_set.problems)
    for ex in WORKED_EXAMPLES:  # the examples are the file's problems verbatim, solved to the file's answer
        row = next(r for r in rows if r["unique_id"] == ex.unique_id)
        assert row["problem"] == ex.problem
        assert f"\\boxed{{{row['answer']}}}" in ex.solution
    # ids are row indices, answers come from our extractor
    first = math_set.problems[0]
    assert rows[first.id]["problem"] == first.problem and first.answer == "0"


def test_prompt_is_two_shot_and_ends_with_the_problem():
    prompt = build_prompt("  What is $1+1$? ")
    assert prompt.startswith(INSTRUCTION)
    assert prompt.count("Problem:") == 3 and prompt.count("\\boxed{") == 3  # instruction + two solved shots
    assert prompt.endswith("Problem: What is $1+1$?\nSolution:")
    assert all(ex.problem in prompt and ex.solution in prompt for ex in WORKED_EXAMPLES)


def test_answer_region_stops_at_an_invented_next_problem():
    assert answer_region(" x = \\boxed{7}.\n\nProblem: next\nSolution: \\boxed{9}") == " x = \\boxed{7}.\n"
    assert answer_region("no next problem \\boxed{3}") == "no next problem \\boxed{3}"


# Answers the question (7), then invents a next problem and boxes its answer (9).
INVENTS_A_PROBLEM = "$3+4=7$, so \\boxed{7}.\n\nProblem: What is $4+5$?\nSolution: $4+5=9$, so \\boxed{9}."


def test_the_paper_scores_the_last_box_of_the_whole_completion():
    paper, cut = MathVerifier(num_workers=1), MathVerifier(num_workers=1, cut_at_next_problem=True)
    try:
        assert paper.score([INVENTS_A_PROBLEM], "7") == [0.0]  # the last box is the invented problem's
        assert paper.score([INVENTS_A_PROBLEM], "9") == [1.0]
        assert cut.score([INVENTS_A_PROBLEM], "7") == [1.0]  # the option reads only the text before "Problem:"
        assert cut.score([INVENTS_A_PROBLEM], "9") == [0.0]
        assert paper.score_pairs([("\\boxed{7}", "7")]) == cut.score_pairs([("\\boxed{7}", "7")]) == [1.0]
    finally:
        paper.close()
        cut.close()


@pytest.fixture(scope="module")
def bpe_tokenizer(math_set):
    core = Tokenizer(models.BPE(unk_token=None))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator((p.problem for p in math_set.problems[:400]), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", pad_token="<eos>")


@pytest.mark.parametrize("limit", [1, 7, 40, 200])
def test_truncation_keeps_the_tail_within_the_budget(bpe_tokenizer, char_tokenizer, math_set, limit):
    for tokenizer in (bpe_tokenizer, char_tokenizer):
        for problem in math_set.problems[:25]:
            text = build_prompt(problem.problem)
            cut = truncate_prompt(text, tokenizer, limit)
            assert text.endswith(cut)
            kept = len(tokenizer(cut, add_special_tokens=False)["input_ids"])
            assert kept <= limit
            if tokenizer is char_tokenizer:  # tokens do not depend on their neighbours: the cut is exact
                assert kept == limit


def test_truncation_widens_its_window_for_long_tokens():
    core = Tokenizer(models.BPE(unk_token=None))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(["abcdefghijklmnopqrstuvwx " * 50], trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>")
    text = "abcdefghijklmnopqrstuvwx " * 100  # ~25 characters per token: the first 8-per-token window is too short
    assert len(tokenizer(text[-40:], add_special_tokens=False)["input_ids"]) <= 5
    cut = truncate_prompt(text, tokenizer, 5)
    assert text.endswith(cut) and len(tokenizer(cut, add_special_tokens=False)["input_ids"]) == 5


def test_truncation_leaves_short_prompts_alone(bpe_tokenizer):
    text = build_prompt("What is $2+2$?")
    assert truncate_prompt(text, bpe_tokenizer, 100_000) == text
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        truncate_prompt(text, bpe_tokenizer, 0)


def test_make_prompts_needs_a_tokenizer_for_a_limit():
    with pytest.raises(ValueError, match="tokenizer"):
        make_prompts([(0, "p", "a")], None, 10)
    assert make_prompts([(3, "p", "a")])[0].text == build_prompt("p")


def write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_malformed_rows_name_the_file_and_line(tmp_path):
    good = json.dumps({"problem": "a", "solution": "\\boxed{1}"})
    missing = write(tmp_path / "missing.jsonl", [good, "", json.dumps({"solution": "x"})])
    with pytest.raises(ValueError, match=r"missing\.jsonl:3: missing field 'problem'"):
        load_math_train(missing)
    wrong_type = write(tmp_path / "type.jsonl", [good, json.dumps({"problem": 5, "solution": "x"})])
    with pytest.raises(ValueError, match=r"type\.jsonl:2: field 'problem' must be str, got int"):
        load_math_train(wrong_type)
    broken = write(tmp_path / "broken.jsonl", [good, '{"problem": "b", "solution": "x"'])
    with pytest.raises(ValueError, match=r"broken\.jsonl:2: not valid JSON"):
        load_math_train(broken)
    no_column = write(tmp_path / "nocol.jsonl", [json.dumps({"question": "a", "solution": "s"})])
    with pytest.raises(ValueError, match="no column 'problem'"):
        load_math_train(no_column)
    with pytest.raises(FileNotFoundError, match="nothere.jsonl"):
        load_records(DataSource(str(tmp_path / "nothere.jsonl")), {"problem": str})


def test_load_records_renames_columns_to_our_fields(tmp_path):
    path = write(tmp_path / "q.jsonl", [json.dumps({"question": "a", "solution": "s", "extra": 1})])
    source = DataSource(path, {"problem": "question"})
    assert load_records(source, {"problem": str, "solution": str}) == [{"problem": "a", "solution": "s"}]
    bad = write(tmp_path / "bad.jsonl", [json.dumps({"question": 3, "solution": "s"})])
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: field 'problem' \(column 'question'\) must be str, got int"):
        load_records(DataSource(bad, {"problem": "question"}), {"problem": str})


def test_rows_without_a_braced_box_are_dropped_and_counted(tmp_path):
    rows = [("p0", "so \\boxed{1}"), ("p1", "so \\boxed 2"), ("p2", "so \\boxed{}"), ("p3", "none")]
    path = write(tmp_path / "t.jsonl", [json.dumps({"problem": p, "solution": s}) for p, s in rows])
    data = load_math_train(path)
    assert data.rows == 4 and data.no_answer == [1, 3]
    assert [(p.id, p.answer) for p in data.problems] == [(0, "1"), (2, "")]


def test_math_task_scores_the_last_box_with_math_verify(tmp_path):
    path = write(tmp_path / "t.jsonl", [json.dumps({"problem": "Half of one?", "solution": "\\boxed{\\frac{1}{2}}"})])
    task = Math(path=path, verifier_workers=1)
    try:
        assert isinstance(task, Task)
        (prompt,) = task.train_prompts()
        assert prompt.text == build_prompt("Half of one?") and prompt.answer == "\\frac{1}{2}"
        completions = ["so \\boxed{0.5}", "\\boxed{1/2}\nProblem: x \\boxed{3}", "\\boxed{2}", "no box"]
        # The paper's rule: the last box of the whole completion, so an invented next problem's box counts.
        assert task.score(completions, prompt.answer) == [1.0, 0.0, 0.0, 0.0]
    finally:
        task.close()
    cut = Math(path=path, verifier_workers=1, cut_at_next_problem=True)
    try:
        assert cut.score(completions, prompt.answer) == [1.0, 1.0, 0.0, 0.0]  # the deviation, as an option
    finally:
        cut.close()


def test_math_task_test_prompts_are_math500(shared_data):
    task = Math(path=str(shared_data / "math_train.jsonl"), test_path=str(shared_data / "math500_test.jsonl"))
    test = task.test_prompts()
    first = json.loads((shared_data / "math500_test.jsonl").open().readline())
    assert len(test) == 500 and test[0].text == build_prompt(first["problem"]) and test[0].answer == first["answer"]
    train_problems = {p.text for p in task.train_prompts()}
    assert not train_problems & {p.text for p in test}
    task.close()


def test_math_task_counts_prompt_tokens_with_the_engines_tokenizer(tmp_path, char_tokenizer):
    rows = [json.dumps({"problem": "x" * 300, "solution": "\\boxed{1}"})]
    task = Math(path=write(tmp_path / "t.jsonl", rows), max_prompt_tokens=40, verifier_workers=1)
    with pytest.raises(ValueError, match="max_prompt_tokens needs a tokenizer"):
        task.train_prompts()
    task.setup(char_tokenizer)
    (prompt,) = task.train_prompts()
    assert len(char_tokenizer(prompt.text)["input_ids"]) == 40
    task.close()
    with pytest.raises(ValueError, match=r"Math options: max_prompt_tokens=0 must be >= 1.*verifier_workers=0"):
        Math(path=str(tmp_path / "t.jsonl"), max_prompt_tokens=0, verifier_workers=0)


def test_datamodule_builds_the_math_task_with_truncated_prompts(shared_data, char_tokenizer):
    from lit_gmc.data.datamodule import RolloutDataModule
    from lit_gmc.data.engines.hf import HFEngine
    from lit_gmc.data.schedules.base import FixedDelay

    task = Math(path=str(shared_data / "math_train.jsonl"), max_prompt_tokens=40, verifier_workers=1)
    dm = RolloutDataModule(task, HFEngine(), FixedDelay(0), actor="tiny", group_size=2, batch_prompts=2,
                           max_new_tokens=4, total_updates=1)  # fmt: skip
    dm.setup("fit")  # the task counts tokens with the engine's tokenizer (the tiny actor's characters)
    try:
        assert len(dm.task.train_prompts()) == 7496
        assert all(len(char_tokenizer(p.text)["input_ids"]) <= 40 for p in dm.task.train_prompts()[:200])
        assert dm.rollout_engine is dm.engine is not None
        batch = dm.next_batch()
        assert batch.rewards.shape == (4,) and set(batch.rewards.tolist()) <= {0.0, 1.0}
        assert batch.input_ids.shape[1] <= 40 + 4
    finally:
        dm.teardown("fit")
        task.close()


@pytest.mark.parametrize("text", ["", "\n  \n"])
def test_an_empty_data_file_is_named(tmp_path, text):
    path = tmp_path / "empty.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=f"{path}: the file has no rows"):
        load_math_train(str(path))
    from lit_gmc.data.tasks.benchmarks import load_benchmark

    with pytest.raises(ValueError, match="the file has no rows"):
        load_benchmark("amc23", source=str(path))
