import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from run_helpers import tiny_data
from transformers import AutoTokenizer

from lit_gmc.actor import build_char_tokenizer
from lit_gmc.callbacks.evaluation import BenchmarkFile, Evaluation, Suite, evaluate_suites, scalars_of
from lit_gmc.callbacks.weight_sync import WeightSync
from lit_gmc.cli import GMCCLI
from lit_gmc.data.tasks.benchmarks import CompletionScorer
from lit_gmc.data.tasks.math_data import make_prompts
from lit_gmc.data.tasks.verifier import MathVerifier
from lit_gmc.errors import UserError
from lit_gmc.module import GMCModule
from lit_gmc.tblog import read_scalars

REPO = Path(__file__).resolve().parents[1]


class ScriptedEngine:
    """A GenerationEngine whose responses are fixed per reference answer (greedy: one text; sampled: a list)."""

    def __init__(self, tokenizer, greedy: dict[str, str], sampled: dict[str, list[str]]) -> None:
        self.tokenizer, self.greedy, self.sampled = tokenizer, greedy, sampled
        self.calls = []

    def generate(self, prompts, n, sampling):
        self.calls.append((len(prompts), n, sampling.temperature, sampling.top_p, sampling.max_new_tokens))
        groups = []
        for prompt in prompts:
            texts = [self.greedy[prompt.answer]] if sampling.temperature == 0 else self.sampled[prompt.answer][:n]
            ids = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
            rows = torch.full((n, max(map(len, ids))), self.tokenizer.pad_token_id)
            for row, seq in enumerate(ids):
                rows[row, : len(seq)] = torch.tensor(seq)
            groups.append(SimpleNamespace(response_ids=rows))
        return groups


@pytest.fixture(scope="module")
def scorer():
    s = MathVerifier(num_workers=1)
    yield s
    s.close()


def test_evaluate_suites_computes_the_papers_metrics(scorer):
    tokenizer = build_char_tokenizer("".join(chr(c) for c in range(32, 127)))  # every printable ASCII character
    engine = ScriptedEngine(
        tokenizer,
        greedy={"5": "so \\boxed{5}", "\\frac{1}{2}": "\\boxed{3}", "7": "\\boxed{7}"},
        sampled={
            "5": ["\\boxed{5}", "\\boxed{6}", "\\boxed{10/2}", "no box"],  # 2 of 4
            "\\frac{1}{2}": ["\\boxed{0.5}", "\\boxed{2}", "\\boxed{1}", "\\boxed{}"],  # 1 of 4
            "7": ["\\boxed{7}"] * 4,
        },
    )
    suites = [
        Suite("a", "A", make_prompts([(0, "p0", "5"), (1, "p1", "\\frac{1}{2}")]), 4, (1, 2, 4)),
        Suite("b", "B", make_prompts([(0, "q0", "7")]), 4, (1, 2, 4)),
    ]
    results = evaluate_suites(engine, tokenizer, scorer, suites, max_new_tokens=32, seed=3)
    a = results["benchmarks"]["a"]
    assert a == pytest.approx({"title": "A", "problems": 2, "skipped": 0, "n": 4, "greedy": 0.5, "avg@n": 0.375,
                               "pass@1": 0.375, "pass@2": (5 / 6 + 1 / 2) / 2, "pass@4": 1.0})  # fmt: skip
    assert results["benchmarks"]["b"]["greedy"] == 1.0 and results["benchmarks"]["b"]["avg@n"] == 1.0
    assert results["macro"] == pytest.approx({"greedy": 0.75, "avg@n": (0.375 + 1.0) / 2})
    # greedy at T=0, then n samples at T=1 and top-p 1, with the completion budget
    assert engine.calls == [(2, 1, 0.0, 1.0, 32), (2, 4, 1.0, 1.0, 32), (1, 1, 0.0, 1.0, 32), (1, 4, 1.0, 1.0, 32)]
    assert set(scalars_of(results)) == {
        "eval/a/greedy", "eval/a/avg@4", "eval/a/pass@1", "eval/a/pass@2", "eval/a/pass@4",
        "eval/b/greedy", "eval/b/avg@4", "eval/b/pass@1", "eval/b/pass@2", "eval/b/pass@4",
        "eval/macro/greedy", "eval/macro/avg@n",
    }  # fmt: skip


def test_options_are_checked_together():
    with pytest.raises(ValueError) as err:
        Evaluation(benchmarks=[], every_n_steps=0, samples=0, max_new_tokens=0)
    message = str(err.value)
    assert all(flag in message for flag in ("benchmarks", "every_n_steps", "samples", "max_new_tokens"))
    with pytest.raises(ValueError, match=r"benchmarks: 5 is neither a benchmark's name nor a BenchmarkFile$"):
        Evaluation(benchmarks=["amc23", 5])


def test_setup_fails_clearly_without_an_engine(shared_data):
    callback = Evaluation(benchmarks=["amc23"], data_dir=str(shared_data))
    with pytest.raises(TypeError, match="generate\\(prompts, n, sampling\\)"):
        callback.setup(pl.Trainer(logger=False, enable_checkpointing=False), None, "fit")
    with pytest.raises(ValueError, match="unknown benchmarks \\['mmlu'\\]"):
        Evaluation(benchmarks=["mmlu"]).setup(pl.Trainer(logger=False, enable_checkpointing=False), None, "fit")


def test_benchmarks_default_to_the_hub_and_sources_override(tmp_path):
    default = Evaluation()
    assert default.data_dir is None and default.sources == {} and default.cut_at_next_problem is False
    folder = tmp_path / "amc23"  # laid out like math-ai/amc23: test.jsonl with id, question, answer, url
    folder.mkdir()
    rows = [{"id": 0, "question": "How many?", "answer": 27.0, "url": "u0"},
            {"id": 1, "question": "How far?", "answer": 36.0, "url": "u1"}]  # fmt: skip
    (folder / "test.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    tokenizer = build_char_tokenizer()
    engine = ScriptedEngine(tokenizer, greedy={}, sampled={})
    trainer = pl.Trainer(logger=False, enable_checkpointing=False)
    for cut in (False, True):
        callback = Evaluation(benchmarks=["amc23"], sources={"amc23": str(folder)}, engine=engine,
                              tokenizer=tokenizer, cut_at_next_problem=cut)  # fmt: skip
        callback.setup(trainer, None, "fit")
        try:
            (suite,) = callback.suites
            asked = [(p.answer, p.text.endswith("How far?\nSolution:")) for p in suite.prompts]
            assert asked == [("27", False), ("36", True)]
            assert suite.n == 16 and callback.scorer.cut_at_next_problem is cut  # the paper's rule unless asked
        finally:
            callback.teardown(trainer, None, "fit")


def exact_match(completions, answer):
    """A user's scorer, named by import path in the tests below: the stripped completion equals the answer."""
    return [float(c.strip() == answer) for c in completions]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_a_benchmark_file_brings_its_own_columns_template_and_scorer(tmp_path):
    sums = write_jsonl(tmp_path / "sums.jsonl", [{"q": "2+3", "target": 5.0}, {"q": "1+1", "target": "2"}])
    tokenizer = build_char_tokenizer("".join(chr(c) for c in range(32, 127)))
    engine = ScriptedEngine(tokenizer, greedy={"5": " 5", "2": "3"}, sampled={"5": ["5", "6", "5 ", "x"],
                                                                               "2": ["2", "2", "1", "0"]})  # fmt: skip
    callback = Evaluation(
        benchmarks=[BenchmarkFile("sums", str(sums), question="q", answer="target", template="Q: {question} =",
                                  scorer="test_evaluation.exact_match", samples=4)],
        ks=(1, 2, 4), engine=engine, tokenizer=tokenizer, max_new_tokens=3,
    )  # fmt: skip
    trainer = pl.Trainer(logger=False, enable_checkpointing=False, default_root_dir=tmp_path)
    callback.setup(trainer, None, "fit")
    (suite,) = callback.suites
    assert [(p.id, p.text, p.answer) for p in suite.prompts] == [(0, "Q: 2+3 =", "5"), (1, "Q: 1+1 =", "2")]
    assert (suite.name, suite.title, suite.n, suite.ks) == ("sums", "sums", 4, (1, 2, 4))
    assert callback.scorer is None  # no math scorer was built: nothing needs it
    results = callback.run(trainer)
    assert json.loads((tmp_path / "eval" / "step_0.json").read_text())["benchmarks"] == results["benchmarks"]
    entry = results["benchmarks"]["sums"]
    # greedy: " 5" is right, "3" is wrong; samples: 2 of 4 ("5", "5 ") and 2 of 4 ("2", "2")
    assert entry == pytest.approx({"title": "sums", "problems": 2, "skipped": 0, "n": 4, "greedy": 0.5, "avg@n": 0.5,
                                   "pass@1": 0.5, "pass@2": 5 / 6, "pass@4": 1.0})  # fmt: skip
    assert set(scalars_of(results)) >= {"eval/sums/greedy", "eval/sums/avg@4", "eval/sums/pass@4"}
    callback.teardown(trainer, None, "fit")


def test_chat_template_wraps_every_benchmark_prompt_after_the_budget_cut(tmp_path, char_tokenizer):
    """Registered and file benchmarks alike: the cut plain prompt, as a user turn, then the assistant's opening."""
    chat = build_char_tokenizer("".join(chr(c) for c in range(32, 127)))
    chat.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                          "{% if add_generation_prompt %}<assistant>{% endif %}")  # fmt: skip
    write_jsonl(tmp_path / "amc23_test.jsonl", [{"problem": "What is 1+1?", "answer": "2"}])
    sums = BenchmarkFile("sums", str(write_jsonl(tmp_path / "s.jsonl", [{"question": "2+3", "answer": 5}])),
                         template="Q: {question} =")  # fmt: skip
    trainer = pl.Trainer(logger=False, enable_checkpointing=False, default_root_dir=tmp_path)

    def suites(tokenizer, chat_template):
        engine, scorer = ScriptedEngine(tokenizer, {}, {}), CompletionScorer(exact_match, "exact_match")
        callback = Evaluation(benchmarks=["amc23", sums], data_dir=str(tmp_path), max_prompt_tokens=30, engine=engine,
                              tokenizer=tokenizer, scorer=scorer, chat_template=chat_template)  # fmt: skip
        callback.setup(trainer, None, "fit")
        return callback.suites

    plain, wrapped = suites(chat, False), suites(chat, True)
    assert len(plain[0].prompts[0].text) == 30 and plain[0].prompts[0].text.endswith("Solution:")  # cut, then wrapped
    for before, after in zip(plain, wrapped, strict=True):
        assert [(p.id, f"<user>{p.text}<assistant>", p.answer) for p in before.prompts] == [
            (p.id, p.text, p.answer) for p in after.prompts]  # fmt: skip
    with pytest.raises(UserError, match="^Evaluation chat_template: the actor's tokenizer has no chat template"):
        suites(char_tokenizer, True)


def test_evaluate_script_s_chat_template_needs_one(tmp_path, tiny_actor_dir, capsys):
    sums = write_jsonl(tmp_path / "sums.jsonl", [{"question": "1+1", "answer": 2}])
    spec = {"name": "sums", "path": str(sums), "template": "{question}=", "scorer": "test_evaluation.exact_match"}
    args = ["--actor", str(tiny_actor_dir), "--benchmarks", "--benchmark-file", json.dumps(spec), "--samples", "1",
            "--max-new-tokens", "2", "--chat-template", "--output", str(tmp_path / "out.json")]  # fmt: skip
    with pytest.raises(SystemExit) as stop:
        load_script().main(args)
    assert stop.value.code == 2
    assert "evaluate.py: error: --chat-template: the actor's tokenizer has no chat template" in capsys.readouterr().err
    tokenizer = AutoTokenizer.from_pretrained(tiny_actor_dir)
    tokenizer.chat_template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    tokenizer.save_pretrained(tiny_actor_dir)
    assert load_script().main(args)["benchmarks"]["sums"]["problems"] == 1


def test_a_benchmark_file_takes_callables_and_sits_beside_a_registered_benchmark(tmp_path, shared_data):
    words = write_jsonl(tmp_path / "words.jsonl", [{"question": "cat", "answer": "tac"}])
    tokenizer = build_char_tokenizer("".join(chr(c) for c in range(32, 127)))
    engine = ScriptedEngine(tokenizer, greedy={"tac": "tac", "27": "\\boxed{27}"},
                            sampled={"tac": ["tac", "cat"], "27": ["\\boxed{27}", "\\boxed{1}"]})  # fmt: skip
    reverse = BenchmarkFile("reverse", str(words), template=lambda q: f"reverse {q}:", scorer=exact_match, samples=2,
                            title="Reverse")  # fmt: skip
    callback = Evaluation(benchmarks=["amc23", reverse], data_dir=str(shared_data), samples=2, max_problems=1,
                          engine=engine, tokenizer=tokenizer, verifier_workers=1)  # fmt: skip
    trainer = pl.Trainer(logger=False, enable_checkpointing=False, default_root_dir=tmp_path)
    callback.setup(trainer, None, "fit")
    try:
        amc, rev = callback.suites
        assert amc.prompts[0].text.endswith("Solution:") and amc.scorer is callback.scorer  # the math template
        assert isinstance(callback.scorer, MathVerifier) and isinstance(rev.scorer, CompletionScorer)
        assert [(p.text, p.answer) for p in rev.prompts] == [("reverse cat:", "tac")] and rev.title == "Reverse"
        results = callback.run(trainer)
    finally:
        callback.teardown(trainer, None, "fit")
    assert results["benchmarks"]["reverse"]["greedy"] == 1.0 and results["benchmarks"]["reverse"]["avg@n"] == 0.5
    assert results["benchmarks"]["amc23"]["greedy"] == 1.0 and results["benchmarks"]["amc23"]["avg@n"] == 0.5
    assert callback.state_key == Evaluation(benchmarks=["amc23", reverse]).state_key  # names only, no reprs


def test_benchmark_file_mistakes_name_the_benchmark_and_the_option(tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", [{"question": "a", "answer": "b"}])
    trainer = pl.Trainer(logger=False, enable_checkpointing=False)
    tokenizer = build_char_tokenizer()
    cases = [
        (BenchmarkFile("t", str(good), template="{question} {answer}"), "'t': template='{question} {answer}'"),
        (BenchmarkFile("t", str(good), template="Q:"), "'t': template='Q:' is not an importable callable"),
        (BenchmarkFile("t", str(good), scorer="no_such_module.score"), "'t': scorer='no_such_module.score' is not"),
        (BenchmarkFile("t", str(good), scorer="json.__doc__"), "'t': scorer='json.__doc__' names a str, not a"),
        (BenchmarkFile("t", str(good), question="q"), "'t': .*good.jsonl: no column 'q'"),
        (BenchmarkFile("t", str(tmp_path / "missing.jsonl")), "'t': data not found"),
    ]
    scorer = CompletionScorer(exact_match, "exact_match")  # for the files without one of their own
    for spec, message in cases:
        with pytest.raises(UserError, match=f"^Evaluation: benchmark {message}"):
            Evaluation(benchmarks=[spec], engine=ScriptedEngine(tokenizer, {}, {}), tokenizer=tokenizer,
                       scorer=scorer).setup(trainer, None, "fit")  # fmt: skip
    with pytest.raises(UserError) as err:
        Evaluation(benchmarks=[BenchmarkFile("gsm8k", "a.jsonl", samples=0), "gsm8k"])
    assert "must have distinct names" in str(err.value) and "samples=0 must be >= 1" in str(err.value)


def test_a_benchmark_file_without_a_scorer_is_refused_unless_the_callback_has_one(tmp_path):
    """As scripts/evaluate.py refuses it: the math scorer would score the file's own answers 0.0 without a word."""
    sums = BenchmarkFile("sums", str(tmp_path / "sums.jsonl"))
    with pytest.raises(UserError) as err:
        Evaluation(benchmarks=["gsm8k", sums])
    assert str(err.value).splitlines()[1:] == [
        f"  benchmarks 'sums': {sums.path} has no scorer; give it one (an import path, e.g. my_project.exact_match) "
        "or give the callback's scorer"
    ]
    Evaluation(benchmarks=["gsm8k", sums], scorer=CompletionScorer(exact_match, "exact_match"))


def test_a_scorer_that_is_not_0_1_is_named():
    scorer = CompletionScorer(lambda completions, answer: [0.5] * len(completions), "half")
    with pytest.raises(ValueError, match="scorer half must return one 0 or 1 per completion"):
        scorer.score_pairs([("a", "x"), ("b", "x")])
    calls = []
    counted = CompletionScorer(lambda c, a: calls.append((list(c), a)) or [1.0] * len(c), "ok")
    assert counted.score_pairs([("a", "x"), ("b", "x"), ("c", "y")]) == [1.0, 1.0, 1.0]
    assert calls == [(["a", "b"], "x"), (["c"], "y")]  # one call per problem's run of samples


def test_benchmark_files_come_from_yaml_through_the_cli_parser():
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(Evaluation, "evaluation")
    config = parser.parse_args(['--evaluation.benchmarks=[gsm8k, {name: sums, path: s.jsonl, template: "{question}=",'
                                ' scorer: my_project.exact}]'])  # fmt: skip
    benchmarks = parser.instantiate(config).evaluation.benchmarks
    assert benchmarks == ["gsm8k", BenchmarkFile("sums", "s.jsonl", template="{question}=", scorer="my_project.exact")]


def make_run(root: Path, shared_data: Path, max_steps: int, ckpt_dir: Path):
    model = GMCModule(actor="tiny", max_response_length=4)
    data = tiny_data(0, actor="tiny", group_size=2, batch_prompts=2, max_new_tokens=4,
                             total_updates=max_steps)  # fmt: skip
    evaluation = Evaluation(
        benchmarks=["amc23", "gsm8k"], every_n_steps=2, at_steps=[0], data_dir=str(shared_data), samples=2,
        max_new_tokens=4, max_prompt_tokens=50, max_problems=3, verifier_workers=1,
    )
    trainer = pl.Trainer(
        max_steps=max_steps, accelerator="cpu", logger=TensorBoardLogger(str(root), name="run", version=0),
        callbacks=[WeightSync(), evaluation, ModelCheckpoint(dirpath=ckpt_dir, save_last=True)],
        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1, num_sanity_val_steps=0,
    )
    return trainer, model, data, evaluation


@pytest.fixture(scope="module")
def trained(tmp_path_factory, shared_data):
    root = tmp_path_factory.mktemp("eval_run")
    trainer, model, data, evaluation = make_run(root, shared_data, 4, root / "ckpt")
    trainer.fit(model, datamodule=data)
    return root, evaluation


def test_callback_evaluates_on_schedule_and_logs(trained):
    root, evaluation = trained
    assert evaluation.evaluated_steps == [0, 2, 4]  # at_steps [0], every 2 steps, the last at the end of training
    assert all(entry["version"] == entry["step"] for entry in evaluation.history)
    first = evaluation.history[0]["benchmarks"]
    assert first["amc23"]["problems"] == 3 and first["gsm8k"]["n"] == 2
    scalars = read_scalars(root / "run" / "version_0")
    for tag in ("eval/amc23/greedy", "eval/gsm8k/avg@2", "eval/gsm8k/pass@2", "eval/macro/greedy", "eval/macro/avg@n"):
        assert [step for step, _ in scalars[tag]] == [0, 2, 4], tag
    saved = json.loads((root / "run" / "version_0" / "eval" / "step_2.json").read_text())
    assert saved["step"] == 2 and set(saved["benchmarks"]) == {"amc23", "gsm8k"}


def test_history_is_restored_on_resume_and_not_redone(trained, shared_data, tmp_path):
    root, evaluation = trained
    trainer, model, data, fresh = make_run(tmp_path, shared_data, 5, tmp_path / "ckpt")
    trainer.fit(model, datamodule=data, ckpt_path=str(root / "ckpt" / "last.ckpt"))
    # Step 4 was evaluated before the checkpoint: the restored history keeps it from running again.
    assert fresh.evaluated_steps == [0, 2, 4]
    assert fresh.history == evaluation.history


def load_script():
    spec = importlib.util.spec_from_file_location("evaluate_script", REPO / "scripts" / "evaluate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_evaluate_script_prints_the_table_and_writes_json(trained, shared_data, tmp_path, capsys):
    root, _ = trained
    out = tmp_path / "results.json"
    load_script().main([
        "--ckpt", str(root / "ckpt" / "last.ckpt"), "--benchmarks", "amc23", "gsm8k", "--data-dir", str(shared_data),
        "--samples", "2", "--limit", "3", "--max-new-tokens", "4", "--max-prompt-tokens", "50",
        "--verifier-workers", "1", "--output", str(out),
    ])  # fmt: skip
    printed = capsys.readouterr().out
    assert "greedy   avg@n" in printed and "AMC23" in printed and "GSM8K" in printed and "macro average" in printed
    report = json.loads(out.read_text())
    assert report["actor"] == "tiny" and set(report["benchmarks"]) == {"amc23", "gsm8k"}
    assert report["benchmarks"]["amc23"]["problems"] == 3 and "pass@2" in report["benchmarks"]["gsm8k"]
    assert 0.0 <= report["macro"]["avg@n"] <= 1.0


def test_evaluate_script_rejects_bad_options(capsys):
    with pytest.raises(SystemExit):
        load_script().parse_args(["--actor", "tiny", "--samples", "0"])
    assert "--samples must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        load_script().parse_args(["--actor", "tiny", "--source", "mmlu=x.jsonl"])
    assert "--source 'mmlu=x.jsonl' must be NAME=PATH" in capsys.readouterr().err


def test_evaluate_script_evaluates_a_benchmark_file_alone_and_writes_every_completion(tmp_path, capsys):
    sums = write_jsonl(tmp_path / "sums.jsonl", [{"question": f"{a}+{a}=", "answer": 2 * a} for a in range(4)])
    out = tmp_path / "results.json"
    load_script().main(["--actor", "tiny", "--benchmark-file", str(sums), "--scorer", "test_evaluation.exact_match",
                        "--samples", "2", "--limit", "3", "--max-new-tokens", "3", "--output", str(out)])  # fmt: skip
    report = json.loads(out.read_text())
    assert list(report["benchmarks"]) == ["sums"]  # the paper's six are not read (no hub access)
    entry = report["benchmarks"]["sums"]
    passes = sorted(key for key in entry if key.startswith("pass@"))
    assert (entry["problems"], entry["n"], passes) == (3, 2, ["pass@1", "pass@2"])
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].split() == ["benchmark", "greedy", "avg@n", "n", "pass@1", "pass@2", "problems", "skipped"]
    cells = [f"{100 * entry[key]:.1f}" for key in ("greedy", "avg@n", "pass@1", "pass@2")]
    assert printed[1].split() == ["sums", *cells[:2], "2", *cells[2:], "3", "0"]
    rows = [json.loads(line) for line in (tmp_path / "results.completions.jsonl").read_text().splitlines()]
    assert printed[-1] == f"wrote {out} and {tmp_path / 'results.completions.jsonl'} (9 completions)"
    assert [(r["mode"], r["problem"], r["sample"]) for r in rows] == [("greedy", p, 0) for p in range(3)] + [
        ("sampled", p, s) for p in range(3) for s in range(2)
    ]
    assert {(r["benchmark"], r["prompt"], r["answer"]) for r in rows} == {
        ("sums", f"{a}+{a}=", str(2 * a)) for a in range(3)
    }
    for row in rows:
        assert row["correct"] == float(row["completion"] == row["answer"])
    greedy = [r["correct"] for r in rows if r["mode"] == "greedy"]
    sampled = [r["correct"] for r in rows if r["mode"] == "sampled"]
    assert (entry["greedy"], entry["avg@n"]) == (pytest.approx(sum(greedy) / 3), pytest.approx(sum(sampled) / 6))


def test_evaluate_script_names_benchmark_file_mistakes(capsys):
    script = load_script()
    for argv, message in [
        (["--benchmark-file", "[1]"], "--benchmark-file '[1]': not a JSON object"),
        (["--benchmark-file", '{"name": "x"}'], "missing 1 required positional argument: 'path'"),
        (["--benchmarks", "gsm8k", "--benchmark-file", '{"name": "gsm8k", "path": "a.jsonl", "scorer": "m.f"}'],
         "benchmark names must be distinct"),
        (["--benchmarks"], "no benchmark: name some with --benchmarks or add --benchmark-file"),
        (["--benchmark-file", "no/such.jsonl"], "--benchmark-file no/such.jsonl: no such file (give a JSON/JSONL file "
                                                "or inline JSON)"),
        (["--benchmark-file", '{"name": "x", "path": "a.jsonl"}'], "--benchmark-file x: no scorer; give --scorer "
                                                                   "my_project.exact_match"),
    ]:  # fmt: skip
        with pytest.raises(SystemExit):
            script.parse_args(["--actor", "tiny", *argv])
        assert message in capsys.readouterr().err, argv


def test_evaluate_script_reads_the_hub_unless_told_otherwise():
    script = load_script()
    args = script.parse_args(["--actor", "tiny"])
    assert (args.data_dir, args.sources, args.cut_at_next_problem) == (None, {}, False)
    args = script.parse_args(["--actor", "tiny", "--source", "amc23=a.jsonl", "--source", "gsm8k=some/mirror",
                              "--data-dir", "../shared/data", "--cut-at-next-problem"])  # fmt: skip
    assert args.sources == {"amc23": "a.jsonl", "gsm8k": "some/mirror"} and args.cut_at_next_problem


@pytest.mark.parametrize(("fragment", "actor"), [("qwen3_1p7b", "1.7B"), (None, "4B"), ("qwen3_8b", "8B")])
def test_qwen_configs_hold_the_paper_defaults(fragment, actor, capsys):
    layered = ["--config", str(REPO / "configs" / "model" / f"{fragment}.yaml")] if fragment else []
    with pytest.raises(SystemExit) as done:
        GMCCLI(args=["fit", "--config", str(REPO / "configs" / "qwen3_4b.yaml"), *layered, "--print_config"])
    assert done.value.code in (0, None)
    config = yaml.safe_load(capsys.readouterr().out)
    model, data, trainer = config["model"], config["data"], config["trainer"]
    assert model["actor"] == f"Qwen/Qwen3-{actor}-Base"  # data.actor is linked to it
    optimizer = config["optimizer"]  # LightningCLI's own optimizer and LR-schedule groups
    assert optimizer == {"class_path": "bitsandbytes.optim.AdamW8bit",
                         "init_args": {"lr": 1e-6, "betas": [0.9, 0.999], "weight_decay": 0.0}}  # fmt: skip
    scheduler = config["lr_scheduler"]
    assert (scheduler["class_path"], scheduler["init_args"]["warmup_fraction"]) == ("lit_gmc.optim.CosineWithWarmup",
                                                                                   0.03)  # fmt: skip
    # fp32 master weights, bf16 compute; bf16 rollouts
    assert (trainer["precision"], model["dtype"], data["engine"]["init_args"]["dtype"]) == (
        "bf16-mixed", "float32", "bfloat16")  # fmt: skip
    assert model["max_grad_norm"] == 1.0
    # the rule is a component with its own threshold; the paper's suites hold Eq. 2's 1/(T B G) for every rule
    correction = model["correction"]
    assert correction["class_path"] == "lit_gmc.rules.GMC"
    assert (correction["init_args"]["cap"], correction["init_args"]["aggregation"]) == (0.28, "seq_sum_over_T")
    assert (data["batch_prompts"], data["group_size"]) == (8, 8)
    assert (data["max_new_tokens"], data["sampling"]) == (4096, {"temperature": 1.0, "top_p": 1.0})
    # 1.7B: vLLM in the learner's process on one GPU (the paper's layout (a)); 4B and 8B: a `vllm serve` of their own
    engine = "engines.vllm.VLLMEngine" if actor == "1.7B" else "engines.vllm_serve.VLLMServers"
    assert data["engine"]["class_path"] == f"lit_gmc.data.{engine}"
    task = data["task"]
    assert task["class_path"] == "lit_gmc.data.tasks.math.Math"
    # the hub by default: a plain clone has no ../shared
    assert (task["init_args"]["path"], task["init_args"]["max_prompt_tokens"]) == (None, 1024)
    assert trainer["max_steps"] == 800
    callbacks = {c["class_path"].rsplit(".", 1)[1]: c.get("init_args", {}) for c in trainer["callbacks"]}
    assert callbacks["Evaluation"]["at_steps"] == [200, 300, 400, 800] and callbacks["Evaluation"]["data_dir"] is None
    checkpoint = config["checkpoint"]
    assert (checkpoint["at_steps"], checkpoint["every_n_train_steps"]) == ([200, 300, 400, 800], 50)
