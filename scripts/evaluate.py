"""Evaluate a saved Lightning checkpoint (or any actor) on the paper's benchmarks with the HF engine.

Writes a JSON of per-benchmark results (greedy accuracy, avg@n, pass@k, macro averages), every completion beside it
(``eval.json`` -> ``eval.completions.jsonl``, one row per sample: benchmark, mode, problem, sample, prompt, answer,
completion, correct), and prints one row per benchmark: greedy, avg@n and pass@k in percent. Examples::

    python scripts/evaluate.py --ckpt runs/addition_tiny/checkpoints/last.ckpt --benchmarks amc23 gsm8k \
        --max-new-tokens 6 --max-prompt-tokens 58 --samples 2 --limit 8 --output eval.json
    python scripts/evaluate.py --actor Qwen/Qwen3-1.7B-Base --device cuda --output base.json

The paper's six benchmarks are evaluated unless ``--benchmark-file`` is given (then only the files, plus any
``--benchmarks`` named). They are read from their hub datasets by default; ``--data-dir ../shared/data`` reads the
local copies instead, and ``--source NAME=PATH`` overrides one benchmark (a JSONL file, a dataset folder or a hub
name). ``--benchmark-file`` is a benchmark of your own: the path of a JSON/JSONL file (columns ``question`` and
``answer``, prompt = the question), or the ``Evaluation`` callback's ``BenchmarkFile`` as inline JSON. Each needs a
scorer, its own (``"scorer"`` in the JSON) or ``--scorer`` (an import path, or ``math`` for the paper's last
``\boxed{}`` + math-verify)::

    python scripts/evaluate.py --ckpt last.ckpt --benchmark-file sums.jsonl --scorer my_project.exact_match
    python scripts/evaluate.py --ckpt last.ckpt --benchmark-file \
        '{"name": "sums", "path": "sums.jsonl", "template": "{question}=", "scorer": "my_project.exact_match"}'
A checkpoint is a file or the sharded folder FSDP2 writes; with ``--ckpt``, ``--actor`` names a local copy of the
checkpoint's actor (for a hub actor on an offline machine). A mistake in an option, a data file or the
checkpoint prints one line and exits with status 2, as ``python -m lit_gmc`` does.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from lit_gmc.actor import load_actor
from lit_gmc.callbacks.evaluation import PAPER_BENCHMARKS, BenchmarkFile, Suite, evaluate_suites, file_suite
from lit_gmc.callbacks.metrics import PAPER_KS
from lit_gmc.data.engines.hf import HFEngine
from lit_gmc.data.tasks.base import prompts_in_chat_template
from lit_gmc.data.tasks.benchmarks import BENCHMARKS, Benchmark, BenchmarkUnreachable, load_benchmark
from lit_gmc.data.tasks.math_data import make_prompts
from lit_gmc.data.tasks.verifier import MathVerifier
from lit_gmc.errors import UserError
from lit_gmc.export import load_checkpoint_actor


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt", "--ckpt_path", dest="ckpt",
                        help="checkpoint of lit_gmc fit, a file or a sharded folder (its actor.* weights)")  # fmt: skip
    parser.add_argument("--actor", help='"tiny", a hub name or a local path of a causal LM, evaluated as is; '
                        "with --ckpt, the model its weights go into (default: the checkpoint's actor)")  # fmt: skip
    parser.add_argument("--benchmarks", nargs="*", default=None, choices=list(BENCHMARKS),
                        help="the paper's benchmarks to run (default: all six, or none when --benchmark-file is "
                        "given)")  # fmt: skip
    parser.add_argument("--benchmark-file", action="append", default=[], metavar="PATH|JSON",
                        help="a benchmark of your own, evaluated instead of the paper's: a JSON/JSONL file with "
                        'question and answer columns, or inline JSON {"name", "path", "question", "answer", '
                        '"template", "scorer", "samples", "title"} as the Evaluation callback\'s BenchmarkFile '
                        "(repeatable)")  # fmt: skip
    parser.add_argument("--scorer", default=None, metavar="IMPORT_PATH",
                        help="scorer of the --benchmark-file benchmarks that name none: a function (completions, "
                        "answer) -> 0/1 list by import path, or math (last \\boxed{} + math-verify)")  # fmt: skip
    parser.add_argument("--data-dir", default=None, help="folder of local benchmark copies (default: the hub)")
    parser.add_argument(
        "--source",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="one benchmark's source: a JSONL file, a dataset folder or a hub name (repeatable)",
    )
    parser.add_argument(
        "--cut-at-next-problem",
        action="store_true",
        help="score only the text before an invented next 'Problem:' (the paper scores it all)",
    )
    parser.add_argument("--samples", type=int, default=None, help="samples per problem (default: the paper's n)")
    parser.add_argument("--ks", type=int, nargs="+", default=list(PAPER_KS), help="pass@k sizes")
    parser.add_argument("--max-new-tokens", type=int, default=4096)
    parser.add_argument("--max-prompt-tokens", type=int, default=1024, help="0 keeps prompts whole")
    parser.add_argument("--chat-template", action="store_true",
                        help="wrap each prompt (after the --max-prompt-tokens cut) in the actor tokenizer's chat "
                        "template, as a user turn and the assistant's opening, as --data.chat_template does in "
                        "training (for an instruction-tuned actor)")  # fmt: skip
    parser.add_argument("--limit", type=int, default=None, help="only the first LIMIT problems of each benchmark")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-rows", type=int, default=64, help="rows (prompts x samples) per generate call")
    parser.add_argument("--verifier-workers", type=int, default=2)
    parser.add_argument("--output", default="eval_results.json", help="where to write the JSON results")
    args = parser.parse_args(argv)
    positive = ("samples", "limit", "max_new_tokens", "batch_rows", "verifier_workers")
    problems = [f"--{name.replace('_', '-')} must be >= 1" for name in positive
                if getattr(args, name) is not None and getattr(args, name) < 1]  # fmt: skip
    if any(k < 1 for k in args.ks):
        problems.append(f"--ks {' '.join(map(str, args.ks))}: every k must be >= 1")
    if args.max_prompt_tokens < 0:
        problems.append("--max-prompt-tokens must be >= 0 (0 keeps prompts whole)")
    if args.ckpt is None and args.actor is None:
        problems.insert(0, "one of --ckpt or --actor is required")
    problems += device_problems(args.device)
    try:
        args.sources = parse_sources(args.source)
    except ValueError as err:
        problems.append(str(err))
    try:
        args.files = [parse_benchmark_file(text) for text in args.benchmark_file]
    except ValueError as err:
        problems.append(str(err))
    problems += scorer_problems(getattr(args, "files", []), args.scorer)
    if args.scorer not in (None, "math"):  # math: the default scorer, given to files without one
        args.files = [spec if spec.scorer else replace(spec, scorer=args.scorer) for spec in getattr(args, "files", [])]
    if args.benchmarks is None:
        args.benchmarks = [] if args.benchmark_file else list(PAPER_BENCHMARKS)
    names = args.benchmarks + [spec.name for spec in getattr(args, "files", [])]
    if not names:
        problems.append("no benchmark: name some with --benchmarks or add --benchmark-file")
    elif len(set(names)) != len(names):
        problems.append(f"benchmark names must be distinct, got {names}")
    if problems:
        parser.error("; ".join(problems))
    return args


def device_problems(device: str) -> list[str]:
    """Why ``--device`` cannot be used here (caught before the model loads), or nothing."""
    try:
        kind = torch.device(device).type
    except RuntimeError as err:
        return [f"--device {device}: {err}"]
    if kind == "cuda" and not torch.cuda.is_available():
        return [f"--device {device}: no CUDA device is available here"]
    return []


def parse_sources(pairs: list[str]) -> dict[str, str]:
    """``["amc23=path", ...]`` as ``{"amc23": "path"}``; raises ``ValueError`` for a bad pair or an unknown name."""
    sources = {}
    for pair in pairs:
        name, sep, path = pair.partition("=")
        if not sep or not path or name not in BENCHMARKS:
            raise ValueError(f"--source {pair!r} must be NAME=PATH with NAME one of {', '.join(BENCHMARKS)}")
        sources[name] = path
    return sources


def scorer_problems(files: list[BenchmarkFile], scorer: str | None) -> list[str]:
    """A benchmark file without a scorer, when ``--scorer`` does not give one (a silent math scorer scored 0.0)."""
    unscored = [spec.name for spec in files if spec.scorer is None]
    if not unscored or scorer is not None:
        return []
    return [f"--benchmark-file {', '.join(unscored)}: no scorer; give --scorer my_project.exact_match (a function "
            '(completions, answer) -> list of 0/1), --scorer math (last \\boxed{} + math-verify), or "scorer" in '
            "its inline JSON"]  # fmt: skip


def parse_benchmark_file(text: str) -> BenchmarkFile:
    """A ``--benchmark-file`` value as a :class:`BenchmarkFile`: a file's path, or inline JSON (starting with ``{``).

    A path becomes ``BenchmarkFile(name=<file stem>, path=<path>)``. Raises ``ValueError`` naming the mistake.
    """
    if not text.lstrip().startswith(("{", "[")):
        if not Path(text).is_file():
            raise ValueError(f"--benchmark-file {text}: no such file (give a JSON/JSONL file or inline JSON)")
        return BenchmarkFile(name=Path(text).name.split(".")[0], path=text)
    try:
        fields = json.loads(text)
        if not isinstance(fields, dict):
            raise TypeError("not a JSON object")
        return BenchmarkFile(**fields)
    except (ValueError, TypeError) as err:
        raise ValueError(f"--benchmark-file {text!r}: {err} (fields: name, path, question, answer, template, "
                         "scorer, samples, title)") from err  # fmt: skip


def load_policy(ckpt: str | None, actor: str | None) -> tuple[torch.nn.Module, Any, str]:
    """``(model, tokenizer, actor name)`` from a checkpoint's ``actor.*`` weights, or an actor as is."""
    if ckpt is None:
        model, tokenizer = load_actor(actor, option="--actor")
        return model, tokenizer, actor
    return load_checkpoint_actor(ckpt, actor, option="--actor")


def load_benchmarks(args: argparse.Namespace) -> list[Benchmark]:
    """The chosen benchmarks, read before the model so that a data mistake costs no model load."""
    try:
        return [load_benchmark(name, source=args.sources.get(name), data_dir=args.data_dir) for name in args.benchmarks]
    except BenchmarkUnreachable as err:
        raise UserError(f"{err}; set --data-dir (a folder of local copies) or --source NAME=PATH") from err


def table(results: dict[str, Any]) -> str:
    """One row per benchmark, in percent: greedy, avg@n (the paper's Table 1 pair) and every pass@k; then the macro
    average. A pass@k above a benchmark's n is ``-``."""
    entries = results["benchmarks"].values()
    ks = sorted({int(key[5:]) for entry in entries for key in entry if key.startswith("pass@")})
    head = f"{'benchmark':<16}{'greedy':>8}{'avg@n':>8}{'n':>4}" + "".join(f"{f'pass@{k}':>9}" for k in ks)
    lines = [head + f"{'problems':>10}{'skipped':>9}"]
    for entry in entries:
        passes = "".join(f"{100 * entry[f'pass@{k}']:>9.1f}" if f"pass@{k}" in entry else f"{'-':>9}" for k in ks)
        skipped = entry.get("skipped", 0)  # rows without a reference answer, left out
        lines.append(f"{entry['title']:<16}{100 * entry['greedy']:>8.1f}{100 * entry['avg@n']:>8.1f}{entry['n']:>4}"
                     f"{passes}{entry['problems']:>10}{skipped:>9}")  # fmt: skip
    macro = results["macro"]
    lines.append(f"{'macro average':<16}{100 * macro['greedy']:>8.1f}{100 * macro['avg@n']:>8.1f}")
    return "\n".join(lines)


def completions_path(output: str) -> Path:
    """Where the completions go: beside ``output``, ``eval.json`` -> ``eval.completions.jsonl``."""
    path = Path(output)
    return path.with_name(path.stem + ".completions.jsonl")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Evaluate; a :class:`UserError` prints one line and exits with status 2."""
    try:
        return evaluate(parse_args(argv))
    except UserError as err:
        print(f"evaluate.py: error: {err}", file=sys.stderr)
        sys.exit(2)


def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    """Run the evaluation that ``args`` describe, write its JSON and print the table."""
    try:  # before the evaluation, which may take hours, rather than at its end
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"--output {args.output}: cannot write there ({err})") from err
    benchmarks = load_benchmarks(args)
    for spec in args.files:  # their data, template and scorer checked before the model too; built again below
        file_suite(spec, None, lambda: None, args.ks)
    model, tokenizer, actor = load_policy(args.ckpt, args.actor)
    # from_model samples with a copy: make it on the CPU and move only the copy, so the device holds one model.
    engine = HFEngine.from_model(model, tokenizer, batch_rows=args.batch_rows)
    del model
    engine.model.to(args.device)
    max_prompt = args.max_prompt_tokens or None
    suites = []
    for bench in benchmarks:
        items = bench.items[: args.limit]
        prompts = make_prompts([(i, it.problem, it.answer) for i, it in enumerate(items)], tokenizer, max_prompt)
        n = args.samples or bench.samples
        suites.append(Suite(bench.name, bench.title, prompts, n, tuple(k for k in args.ks if k <= n),
                            skipped=len(bench.skipped)))  # fmt: skip
    scorers: list[MathVerifier] = []  # the math scorer starts verifier processes: only when a benchmark needs it

    def math_scorer() -> MathVerifier:
        if not scorers:
            verifier = MathVerifier(num_workers=args.verifier_workers, cut_at_next_problem=args.cut_at_next_problem)
            scorers.append(verifier)
        return scorers[0]

    start = time.perf_counter()
    samples: list[dict[str, Any]] = []
    try:
        suites = [replace(suite, scorer=math_scorer()) for suite in suites]
        suites += [file_suite(spec, tokenizer, math_scorer, args.ks, args.samples, args.limit, max_prompt)
                   for spec in args.files]  # fmt: skip
        if args.chat_template:  # every suite, after the --max-prompt-tokens cut
            for suite in suites:
                suite.prompts = prompts_in_chat_template(suite.prompts, tokenizer, "--chat-template")
        results = evaluate_suites(engine, tokenizer, None, suites, args.max_new_tokens, args.seed, samples)
    finally:
        for scorer in scorers:
            scorer.close()
        engine.close()
    settings = {k: v for k, v in vars(args).items() if k not in ("output", "source", "files")}
    report = {"actor": actor, "settings": settings, "seconds": round(time.perf_counter() - start, 2), **results}
    Path(args.output).write_text(json.dumps(report, indent=2))
    completions = completions_path(args.output)
    completions.write_text("".join(json.dumps(row) + "\n" for row in samples))
    print(table(results))
    print(f"wrote {args.output} and {completions} ({len(samples)} completions)")
    return report


if __name__ == "__main__":
    main()
