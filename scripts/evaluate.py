"""Evaluate a saved Lightning checkpoint (or any actor) on the paper's benchmarks with the HF engine.

Writes a JSON of per-benchmark results (greedy accuracy, avg@n, pass@k, macro averages) and prints the
paper's Table 1 layout, "greedy / avg@n" in percent per benchmark. Examples::

    python scripts/evaluate.py --ckpt runs/tiny/version_0/checkpoints/last.ckpt --benchmarks amc23 gsm8k \
        --max-new-tokens 6 --max-prompt-tokens 58 --samples 2 --limit 8 --output eval.json
    python scripts/evaluate.py --actor Qwen/Qwen3-1.7B-Base --device cuda --output base.json

Benchmarks are read from their hub datasets by default; ``--data-dir ../shared/data`` reads the local copies
instead, and ``--source NAME=PATH`` overrides one benchmark (a JSONL file, a dataset folder or a hub name).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from lit_gmc.actor import load_actor
from lit_gmc.callbacks.evaluation import PAPER_BENCHMARKS, Suite, evaluate_suites
from lit_gmc.callbacks.metrics import PAPER_KS
from lit_gmc.data.benchmarks import BENCHMARKS, load_benchmark
from lit_gmc.data.engines import HFEngine
from lit_gmc.data.math_data import MathScorer, make_prompts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--ckpt", help="Lightning checkpoint of a GMCModule (the actor is read from its state_dict)")
    source.add_argument("--actor", help='"tiny", a hub name or a local path of a causal LM, evaluated as is')
    parser.add_argument("--benchmarks", nargs="+", default=list(PAPER_BENCHMARKS), choices=list(BENCHMARKS))
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
    parser.add_argument("--limit", type=int, default=None, help="only the first LIMIT problems of each benchmark")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-rows", type=int, default=64, help="rows (prompts x samples) per generate call")
    parser.add_argument("--verifier-workers", type=int, default=2)
    parser.add_argument("--output", default="eval_results.json", help="where to write the JSON results")
    args = parser.parse_args(argv)
    positive = ("samples", "limit", "max_new_tokens", "batch_rows")
    problems = [f"--{name.replace('_', '-')} must be >= 1" for name in positive
                if getattr(args, name) is not None and getattr(args, name) < 1]  # fmt: skip
    try:
        args.sources = parse_sources(args.source)
    except ValueError as err:
        problems.append(str(err))
    if problems:
        parser.error("; ".join(problems))
    return args


def parse_sources(pairs: list[str]) -> dict[str, str]:
    """``["amc23=path", ...]`` as ``{"amc23": "path"}``; raises ``ValueError`` for a bad pair or an unknown name."""
    sources = {}
    for pair in pairs:
        name, sep, path = pair.partition("=")
        if not sep or not path or name not in BENCHMARKS:
            raise ValueError(f"--source {pair!r} must be NAME=PATH with NAME one of {', '.join(BENCHMARKS)}")
        sources[name] = path
    return sources


def load_policy(ckpt: str | None, actor: str | None) -> tuple[torch.nn.Module, Any, str]:
    """``(model, tokenizer, actor name)`` from a checkpoint's ``actor.*`` weights, or an actor as is."""
    if ckpt is None:
        model, tokenizer = load_actor(actor)
        return model, tokenizer, actor
    # Lightning checkpoints pickle their hyper-parameters, so weights_only loading cannot read them:
    # only evaluate checkpoints you trust.
    checkpoint = torch.load(ckpt, map_location="cpu", weights_only=False)
    name = checkpoint.get("hyper_parameters", {}).get("actor")
    if name is None:
        raise ValueError(f"{ckpt}: no hyper_parameters['actor']; is this a GMCModule checkpoint?")
    model, tokenizer = load_actor(name)
    prefix = "actor."
    state = {k[len(prefix) :]: v for k, v in checkpoint["state_dict"].items() if k.startswith(prefix)}
    if not state:
        raise ValueError(f"{ckpt}: no 'actor.*' weights in state_dict")
    model.load_state_dict(state)
    return model, tokenizer, name


def table(results: dict[str, Any]) -> str:
    """The paper's Table 1 layout: one row per benchmark, "greedy / avg@n" in percent, then the macro average."""
    lines = [f"{'benchmark':<16}{'greedy / avg@n':>18}{'n':>5}{'problems':>10}"]
    for entry in results["benchmarks"].values():
        cell = f"{100 * entry['greedy']:.1f} / {100 * entry['avg@n']:.1f}"
        lines.append(f"{entry['title']:<16}{cell:>18}{entry['n']:>5}{entry['problems']:>10}")
    macro = results["macro"]
    cell = f"{100 * macro['greedy']:.1f} / {100 * macro['avg@n']:.1f}"
    lines.append(f"{'macro average':<16}{cell:>18}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    model, tokenizer, actor = load_policy(args.ckpt, args.actor)
    # from_model samples with a copy: make it on the CPU and move only the copy, so the device holds one model.
    engine = HFEngine.from_model(model, tokenizer, batch_rows=args.batch_rows)
    del model
    engine.model.to(args.device)
    max_prompt = args.max_prompt_tokens or None
    suites = []
    for name in args.benchmarks:
        bench = load_benchmark(name, source=args.sources.get(name), data_dir=args.data_dir)
        items = bench.items[: args.limit]
        prompts = make_prompts([(i, it.problem, it.answer) for i, it in enumerate(items)], tokenizer, max_prompt)
        n = args.samples or bench.samples
        suites.append(Suite(name, bench.title, prompts, n, tuple(k for k in args.ks if k <= n)))
    scorer = MathScorer(num_workers=args.verifier_workers, cut_at_next_problem=args.cut_at_next_problem)
    start = time.perf_counter()
    try:
        results = evaluate_suites(engine, tokenizer, scorer, suites, args.max_new_tokens, args.seed)
    finally:
        scorer.close()
        engine.close()
    settings = {k: v for k, v in vars(args).items() if k not in ("output", "source")}
    report = {"actor": actor, "settings": settings, "seconds": round(time.perf_counter() - start, 2), **results}
    Path(args.output).write_text(json.dumps(report, indent=2))
    print(table(results))
    print(f"wrote {args.output}")
    return report


if __name__ == "__main__":
    main()
