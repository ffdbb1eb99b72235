import json
import re

import pytest

from lit_gmc.data.tasks.answers import last_boxed, strip_dollars
from lit_gmc.data.tasks.benchmarks import BENCHMARKS, load_benchmark
from lit_gmc.data.tasks.math_data import is_file_source, is_local
from lit_gmc.data.tasks.verifier import MathVerifier

SKIPPED = {"gaokao2023en": ["168", "193"]}  # the rows' lines in the local copy
COUNTS = {"math500": 500, "gsm8k": 1319, "gaokao2023en": 385, "olympiadbench": 675, "minerva": 272, "amc23": 40}


def rows(path):
    return [json.loads(line) for line in path.open()]


@pytest.mark.parametrize(("name", "count"), list(COUNTS.items()))
def test_row_counts(shared_data, name, count):
    bench = load_benchmark(name, data_dir=str(shared_data))
    assert len(bench.items) + len(bench.skipped) == count
    # Rows without a reference answer are left out and counted: two of Gaokao2023-En's (they could only score 0)
    assert [location.rpartition(":")[2] for location in bench.skipped] == SKIPPED.get(name, [])
    assert bench.name == name and bench.title == BENCHMARKS[name].title
    assert all(isinstance(it.problem, str) and it.problem for it in bench.items)
    assert not any(re.search(r"(?<!\\)\$", it.answer) for it in bench.items)  # math delimiters are gone


def test_paper_sample_counts():
    assert {name: spec.samples for name, spec in BENCHMARKS.items()} == {
        "math500": 16, "gsm8k": 8, "gaokao2023en": 8, "olympiadbench": 8, "minerva": 16, "amc23": 16,
    }  # fmt: skip


def test_answer_formats(shared_data):
    gsm8k = load_benchmark("gsm8k", data_dir=str(shared_data)).items
    assert gsm8k[0].answer == "18" and all(re.fullmatch(r"-?\d+(\.\d+)?", it.answer) for it in gsm8k)
    raw_gsm8k = rows(shared_data / "gsm8k_test.jsonl")
    assert any("," in r["answer"].rsplit("####", 1)[1] for r in raw_gsm8k)  # separators existed and were removed
    amc = load_benchmark("amc23", data_dir=str(shared_data)).items
    assert [it.answer for it in amc[:3]] == ["27", "36", "45"]
    minerva = load_benchmark("minerva", data_dir=str(shared_data)).items
    raw_minerva = rows(shared_data / "minerva_math_test.jsonl")
    assert [it.answer for it in minerva] == [strip_dollars(last_boxed(r["solution"])) for r in raw_minerva]
    olympiad = load_benchmark("olympiadbench", data_dir=str(shared_data)).items
    raw_olympiad = rows(shared_data / "olympiadbench_OE_TO_maths_en_COMP_test.jsonl")
    multi = [(it.answer, r["final_answer"]) for it, r in zip(olympiad, raw_olympiad, strict=True)
             if r["is_multiple_answer"]]  # fmt: skip
    assert len(multi) == 94
    assert ("(1,8,19), (2,7,13), (4,5,7)", ["$(1,8,19), (2,7,13), (4,5,7)$"]) in multi
    gaokao = load_benchmark("gaokao2023en", data_dir=str(shared_data)).items
    assert gaokao[0].answer == "\\{x|-2\\leq x < 1\\}"


@pytest.fixture(scope="module")
def scorer():
    s = MathVerifier(num_workers=2, timeout_s=10.0)
    yield s
    s.close()


@pytest.mark.parametrize("name", list(COUNTS))
def test_references_verify_against_themselves(shared_data, scorer, name):
    items = load_benchmark(name, data_dir=str(shared_data)).items[:15]
    pairs = [(f"so the answer is $\\boxed{{{it.answer}}}$.", it.answer) for it in items]
    assert scorer.score_pairs(pairs) == [1.0] * len(items)


def write(path, records):
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return str(path)


def test_bad_rows_name_the_file_and_line(tmp_path):
    gsm = write(tmp_path / "gsm.jsonl", [{"question": "q", "answer": "#### 3"}, {"question": "q", "answer": "3"}])
    with pytest.raises(ValueError, match=r"gsm\.jsonl:2: column 'answer': no '#### <answer>' line"):
        load_benchmark("gsm8k", source=gsm)
    oly = write(tmp_path / "oly.jsonl", [{"question": "q", "final_answer": []}])
    with pytest.raises(ValueError, match=r"oly\.jsonl:1: column 'final_answer': reference answer must be"):
        load_benchmark("olympiadbench", source=oly)
    amc = write(tmp_path / "amc.jsonl", [{"problem": "p", "answer": 1.0}, {"problem": "p"}])
    with pytest.raises(ValueError, match=r"amc\.jsonl:2: missing field 'answer'"):
        load_benchmark("amc23", source=amc)
    minerva = write(tmp_path / "minerva.jsonl", [{"problem": "p", "solution": "so \\boxed{}"}])
    with pytest.raises(ValueError, match=r"minerva\.jsonl:1: column 'solution': no complete \\boxed\{\} with an"):
        load_benchmark("minerva", source=minerva)
    # The local GSM8K copy keeps the hub's column names, so the message names the column the user sees.
    with pytest.raises(ValueError, match=r"gsm2\.jsonl:1: missing field 'rationale' \(column 'answer'\)"):
        load_benchmark("gsm8k", source=write(tmp_path / "gsm2.jsonl", [{"question": "q", "answer": None}]))


def test_unknown_benchmark_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown benchmark 'mmlu'; known: math500, gsm8k"):
        load_benchmark("mmlu")


def test_local_paths_and_hub_names_are_told_apart(tmp_path):
    assert is_local("data/x.jsonl") and is_local(str(tmp_path))
    assert not is_local("HuggingFaceH4/MATH-500")
    # Only a JSON file is read as one; a folder goes through load_dataset(folder, config, split) like a hub name.
    assert is_file_source("data/x.jsonl") and not is_file_source(str(tmp_path))


def test_a_users_benchmark_file_keeps_its_text_answers_verbatim(tmp_path):
    from lit_gmc.data.tasks.benchmarks import load_file_items
    from lit_gmc.errors import UserError

    path = tmp_path / "own.jsonl"
    rows = [{"q": "x", "a": "$5$"}, {"q": "y", "a": 27.0}, {"q": "z", "a": 3}, {"q": "w", "a": 0.5}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    items, _ = load_file_items(str(path), question="q", answer="a")
    assert [(it.problem, it.answer) for it in items] == [("x", "$5$"), ("y", "27"), ("z", "3"), ("w", "0.5")]
    path.write_text(json.dumps({"q": "x", "a": False}) + "\n\n" + json.dumps({"q": "y", "a": True}) + "\n")
    with pytest.raises(UserError, match=r"own\.jsonl:1: field 'answer' \(column 'a'\) must be str or int or float"):
        load_file_items(str(path), question="q", answer="a")


def test_benchmark_rows_without_a_reference_answer_are_left_out_and_counted(tmp_path):
    import json

    from lit_gmc.callbacks.evaluation import BenchmarkFile, file_suite
    from lit_gmc.data.tasks.benchmarks import load_benchmark

    rows = [{"problem": "1+1?", "answer": "2"}, {"problem": "No answer?", "answer": ""}, {"problem": "3?", "answer": 3}]
    path = tmp_path / "amc23_test.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    bench = load_benchmark("amc23", data_dir=str(tmp_path))
    assert [item.answer for item in bench.items] == ["2", "3"]
    assert bench.skipped == (f"{path}:2",)  # file and line
    user_rows = [{"question": "2+3=", "answer": "5"}, {"question": "?", "answer": "  "}]
    user = tmp_path / "sums.jsonl"
    user.write_text("\n".join(json.dumps(row) for row in user_rows) + "\n")
    suite = file_suite(BenchmarkFile("sums", str(user), template="{question}", samples=1), None, lambda: None, (1,))
    assert len(suite.prompts) == 1 and suite.skipped == 1
