"""The default hub sources, read without network access.

Each test builds a folder laid out like the hub repository (the same file names, split names, config
README and column names as the dataset card) and reads it through the real spec, with only the dataset
name replaced by the folder: ``load_dataset(folder, config, split=...)`` is the same call a hub name takes.
"""

import json
from dataclasses import replace

import datasets
import pytest

from lit_gmc.data.tasks import math_data
from lit_gmc.data.tasks.answers import last_boxed
from lit_gmc.data.tasks.benchmarks import (
    AMC23_HUB,
    BENCHMARKS,
    GSM8K_HUB,
    MINERVA_HUB,
    BenchmarkItem,
    load_benchmark,
    load_items,
)
from lit_gmc.data.tasks.math_data import (
    MATH_TRAIN_SOURCE,
    WORKED_EXAMPLES,
    DataSource,
    load_math_train,
    resolve_source,
)


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_parquet(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    datasets.Dataset.from_list(rows).to_parquet(str(path))


def write_card(folder, configs):
    """A README whose YAML ``configs`` maps each config's splits to files, as multi-config hub datasets do."""
    lines = ["---", "configs:"]
    for name, splits in configs.items():
        lines += [f"- config_name: {name}", "  data_files:"]
        lines += [f"  - split: {split}\n    path: {path}" for split, path in splits.items()]
    (folder / "README.md").write_text("\n".join([*lines, "---", ""]))


def shared_rows(shared_data, filename, count=6):
    with (shared_data / filename).open() as handle:
        return [json.loads(line) for _, line in zip(range(count), handle, strict=False)]


def gsm8k_layout(folder, rows):
    """openai/gsm8k: configs ``main`` and ``socratic``, ``<config>/<split>-00000-of-00001.parquet``."""
    main = [{"question": r["question"], "answer": r["answer"]} for r in rows]
    socratic = [{"question": r["question"], "answer": "Q: why? ** because.\n#### 0"} for r in rows]
    for config, split_rows in (("main", main), ("socratic", socratic)):
        for split in ("train", "test"):
            write_parquet(folder / config / f"{split}-00000-of-00001.parquet", split_rows)
    files = {c: {s: f"{c}/{s}-00000-of-00001.parquet" for s in ("train", "test")} for c in ("main", "socratic")}
    write_card(folder, files)


def olympiad_layout(folder, rows):
    """Hothan/OlympiadBench: one config per subset, each with a single ``train`` split (file paths are ours)."""
    write_parquet(folder / "OE_TO_maths_en_COMP" / "train.parquet", rows)
    physics = [{**r, "final_answer": ["not maths"]} for r in rows]
    write_parquet(folder / "OE_TO_physics_en_COMP" / "train.parquet", physics)
    subsets = ("OE_TO_maths_en_COMP", "OE_TO_physics_en_COMP")
    write_card(folder, {name: {"train": f"{name}/train.parquet"} for name in subsets})


LAYOUTS = {
    "math500": lambda folder, rows: write_jsonl(folder / "test.jsonl", rows),
    "gsm8k": gsm8k_layout,
    "gaokao2023en": lambda folder, rows: write_jsonl(folder / "Gaokao2023-Math-En.jsonl", rows),
    "olympiadbench": olympiad_layout,
    # math-ai/minervamath holds the final answer, where the local copy holds the worked solution.
    "minerva": lambda folder, rows: write_jsonl(
        folder / "test.jsonl", [{"question": r["problem"], "answer": last_boxed(r["solution"])} for r in rows]
    ),
    "amc23": lambda folder, rows: write_jsonl(
        folder / "test.jsonl", [{k: r[k] for k in ("id", "question", "answer", "url")} for r in rows]
    ),
}


def test_hub_specs_are_the_checked_cards():
    specs = {name: (s.hub.path, s.hub.config, s.hub.split, dict(s.hub.columns)) for name, s in BENCHMARKS.items()}
    assert specs == {
        "math500": ("HuggingFaceH4/MATH-500", None, "test", {"problem": "problem", "answer": "answer"}),
        "gsm8k": ("openai/gsm8k", "main", "test", {"problem": "question", "rationale": "answer"}),
        "gaokao2023en": ("MARIO-Math-Reasoning/Gaokao2023-Math-En", None, "train",
                         {"problem": "question", "answer": "answer"}),
        "olympiadbench": ("Hothan/OlympiadBench", "OE_TO_maths_en_COMP", "train",
                          {"problem": "question", "answer": "final_answer"}),
        "minerva": ("math-ai/minervamath", None, "test", {"problem": "question", "answer": "answer"}),
        "amc23": ("math-ai/amc23", None, "test", {"problem": "question", "answer": "answer"}),
    }  # fmt: skip
    train = (MATH_TRAIN_SOURCE.path, MATH_TRAIN_SOURCE.config, MATH_TRAIN_SOURCE.split)
    assert train == ("DigitalLearningGmbH/MATH-lighteval", "default", "train")
    assert not any(path.startswith("..") for path in (MATH_TRAIN_SOURCE.path, BENCHMARKS["math500"].hub.path))


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_hub_layout_reads_like_the_local_copy(shared_data, tmp_path, name):
    spec = BENCHMARKS[name]
    rows = shared_rows(shared_data, spec.filename)
    LAYOUTS[name](tmp_path / "hub", rows)
    local = load_benchmark(name, source=str(write_jsonl(tmp_path / spec.filename, rows))).items
    from_spec = load_benchmark(name, source=replace(spec.hub, path=str(tmp_path / "hub"))).items
    from_folder = load_benchmark(name, source=str(tmp_path / "hub")).items  # a folder takes the hub spec
    assert len(local) == len(rows) and from_spec == local and from_folder == local


def test_the_default_source_is_the_hub(tmp_path, monkeypatch):
    rows = [{"question": "Two and two?", "answer": "2+2=<<2+2=4>>4\n#### 4"},
            {"question": "Big?", "answer": "#### 1,450,000"}]  # fmt: skip
    gsm8k_layout(tmp_path / "gsm8k", rows)
    spec = BENCHMARKS["gsm8k"]
    monkeypatch.setitem(BENCHMARKS, "gsm8k", replace(spec, hub=replace(spec.hub, path=str(tmp_path / "gsm8k"))))
    # Config "main", not "socratic" (whose answers are all 0), and split "test", as on the card.
    assert load_benchmark("gsm8k").items == [BenchmarkItem("Two and two?", "4"), BenchmarkItem("Big?", "1450000")]
    assert load_benchmark("gsm8k", config="socratic").items[0].answer == "0"


def test_minerva_and_amc23_hub_columns_need_no_shared_data(tmp_path):
    write_jsonl(tmp_path / "minerva" / "test.jsonl", [{"question": "Speed?", "answer": "$3 \\times 10^8$"}])
    write_jsonl(tmp_path / "amc" / "test.jsonl", [{"id": 0, "question": "How many?", "answer": 27.0, "url": "u"}])
    assert load_items(replace(MINERVA_HUB, path=str(tmp_path / "minerva")))[0] == [
        BenchmarkItem("Speed?", "3 \\times 10^8")
    ]
    assert load_items(replace(AMC23_HUB, path=str(tmp_path / "amc")))[0] == [BenchmarkItem("How many?", "27")]
    # A row that breaks the format names the row and the hub's column.
    write_jsonl(tmp_path / "bad" / "test.jsonl", [{"question": "q", "answer": "no marker"}])
    with pytest.raises(ValueError, match=r"bad \(config 'default', split 'test'\) row 0: column 'answer': no '####"):
        load_items(replace(GSM8K_HUB, path=str(tmp_path / "bad"), config="default"))


def test_math_train_hub_layout_reads_like_the_local_file(shared_data, tmp_path, monkeypatch):
    rows = [json.loads(line) for line in (shared_data / "math_train.jsonl").open()]
    shots = {ex.unique_id for ex in WORKED_EXAMPLES}
    picked = rows[:5] + [r for r in rows if r["unique_id"] in shots or "\\boxed " in r["solution"]]
    hub_rows = [{k: r[k] for k in ("problem", "level", "solution", "type")} for r in picked]
    folder = tmp_path / "MATH-lighteval"
    for config, config_rows in (("default", hub_rows), ("algebra", hub_rows[:1])):
        for split in ("train", "test"):
            write_parquet(folder / config / f"{split}-00000-of-00001.parquet", config_rows)
    files = {c: {s: f"{c}/{s}-00000-of-00001.parquet" for s in ("train", "test")} for c in ("default", "algebra")}
    write_card(folder, files)
    local = load_math_train(str(write_jsonl(tmp_path / "train.jsonl", picked)))
    monkeypatch.setattr(math_data, "MATH_TRAIN_SOURCE", replace(MATH_TRAIN_SOURCE, path=str(folder)))
    from_hub = load_math_train()  # the default: config "default", split "train"
    assert (from_hub.rows, len(from_hub.no_answer), len(from_hub.held_out)) == (len(picked), 2, 2)
    assert from_hub == local
    # Math passes its path as a string and split="train"; a folder keeps the spec's config.
    assert load_math_train(str(folder), split="train") == local


def test_local_overrides_and_missing_paths(tmp_path):
    hub = BENCHMARKS["minerva"].hub
    assert resolve_source(None, hub) == hub
    assert resolve_source("mirror/minerva", hub) == replace(hub, path="mirror/minerva")
    local = resolve_source("copy.jsonl", hub, {"problem": "problem", "solution": "solution"}, split="x")
    assert local == DataSource("copy.jsonl", {"problem": "problem", "solution": "solution"}, None, "x")
    with pytest.raises(FileNotFoundError, match="nope"):
        load_benchmark("amc23", source=str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="amc23_test.jsonl"):
        load_benchmark("amc23", data_dir=str(tmp_path))
    with pytest.raises(ValueError, match="exactly one of answer, solution, rationale"):
        load_items(DataSource("x", {"problem": "q"}))
