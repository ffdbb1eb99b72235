"""Run a grid of ``lit_gmc fit`` runs (method x delay x G x seed), then evaluate each run's checkpoints.

Every run is a separate process with its own folder ``OUT/runs/<name>/``: the run's config
(``config.json``, layered over the embedded default), its TensorBoard log (``tb/``), checkpoints
(``checkpoints/``), the training log (``train.log``), the held-out evaluation of each checkpoint
(``eval/step_<n>.json``, the format of ``lit_gmc.callbacks.evaluation``) and, once all of that is
complete, ``done.json``. ``OUT/manifest.json`` lists every run with its parameters and status, and every
sweep command that added to it.

Resumable: a run with ``done.json`` is skipped; a run interrupted mid-training restarts from its
``last.ckpt`` (``--ckpt_path last``); evaluation skips checkpoints already evaluated. A run whose name exists
with a different config is an error rather than a silent mix. Examples::

    python scripts/sweep.py run --out runs/study --methods gmc tic grpo --delays 0 8 32 128 --seeds 0 1 2 \
        --max-steps 400 --checkpoint-every 100 --parallel 2
    python scripts/sweep.py run --out runs/study --methods gmc --delays 128 --seeds 0 1 2 --max-steps 400 \
        --checkpoint-every 100 --eps-schedule corollary1
    python scripts/sweep.py run --out runs/fixed --methods gmc tic grpo --delays 0 32 128 --seeds 0 --max-steps 400 \
        --checkpoint-every 100 --aggregation seq_sum_over_T    # one aggregation for every rule, as the paper's suites
    python scripts/sweep.py evaluate runs/study/runs/gmc-d128-g8-s0     # (re)evaluate one run's checkpoints
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

EVAL_SUITE = "heldout"
"""The name of a task's held-out evaluation, except where the task's held-out set is a named benchmark."""
TASK_BENCHMARKS = {"Math": ("math500", "MATH-500")}
"""Tasks whose ``test_prompts`` are a benchmark: the evaluation takes the benchmark's name and title, the ones the
``Evaluation`` callback writes, so a sweep's runs and runs launched with ``lit_gmc fit`` feed the same tables."""


def eval_suite_name(task_name: str) -> tuple[str, str]:
    """``(name, title)`` of a sweep's evaluation of ``task_name``'s held-out prompts."""
    return TASK_BENCHMARKS.get(task_name, (EVAL_SUITE, f"{task_name} (held-out)"))


GRID_KEYS = ("model.correction", "data.schedule", "data.group_size", "data.seed", "trainer.max_steps",
             "checkpoint")  # fmt: skip
"""Config keys the grid sets itself (with ``seed_everything``, which ``--set`` cannot name); ``--set`` may not
override them, or the run names would lie."""


@dataclass(frozen=True)
class RunSpec:
    """One point of the grid."""

    method: str
    delay: int
    group_size: int
    seed: int
    max_steps: int
    checkpoint_every: int
    eps_schedule: str = "constant"
    tag: str = ""
    overrides: dict[str, Any] = field(default_factory=dict)
    aggregation: str | None = None  # None: each rule's own (its authors')

    @property
    def name(self) -> str:
        parts = [self.method, f"d{self.delay}", f"g{self.group_size}", f"s{self.seed}"]
        if self.eps_schedule != "constant":
            parts.append(self.eps_schedule)
        if self.aggregation is not None:
            parts.append(self.aggregation)
        if self.tag:
            parts.append(self.tag)
        return "-".join(parts)


def expand_grid(args: argparse.Namespace) -> list[RunSpec]:
    """Every combination of the grid's axes, in a stable order (method, delay, G, seed)."""
    overrides = dict(parse_override(item) for item in args.set)
    return [
        RunSpec(
            m.lower(),
            d,
            g,
            s,
            args.max_steps,
            args.checkpoint_every,
            args.eps_schedule,
            args.tag,
            overrides,
            args.aggregation,
        )
        for m, d, g, s in itertools.product(args.methods, args.delays, args.group_sizes, args.seeds)
    ]


def rule_class_path(method: str) -> str:
    """The import path of the rule a ``--methods`` entry names (``gmc`` or ``GMC``: ``lit_gmc.rules.GMC``)."""
    from lit_gmc.rules import registered

    names = {name.lower(): name for name in registered()}
    return f"lit_gmc.rules.{names[method.lower()]}"


def rule_options(spec: RunSpec) -> dict[str, Any]:
    """The rule's init args the grid sets: GMC's cap schedule and the aggregation, when not their defaults."""
    options: dict[str, Any] = {}
    if spec.eps_schedule != "constant":
        options["cap_schedule"] = spec.eps_schedule
    if spec.aggregation is not None:
        options["aggregation"] = spec.aggregation
    return options


def parse_override(item: str) -> tuple[str, Any]:
    """``"optimizer.init_args.lr=1e-4"`` -> ``("optimizer.init_args.lr", 1e-4)``: the value is read as JSON, else as
    YAML (PyYAML's YAML 1.1 would read ``1e-4`` as a string)."""
    key, sep, value = item.partition("=")
    if not sep or not re.fullmatch(r"[a-z_]+(\.[a-z_0-9]+)+", key):
        raise argparse.ArgumentTypeError(
            f"--set {item!r}: expected SECTION.KEY=VALUE, e.g. optimizer.init_args.lr=1e-4"
        )
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, yaml.safe_load(value)


def suite_schedule(delay: int) -> dict[str, Any]:
    """The schedule of the paper's fixed-delay suite at ``D = delay``: a FIFO of D batches, except D = 0, which is
    the paper's synchronous protocol (Algorithm 1 with 4 inner steps: 256 responses per generation round)."""
    if delay == 0:
        return {"class_path": "lit_gmc.data.schedules.base.Sync", "init_args": {"inner_steps": 4}}
    return {"class_path": "lit_gmc.data.schedules.base.FixedDelay", "init_args": {"delay": delay}}


def build_component(spec: dict[str, Any] | None, default: str) -> Any:
    """The object a config's ``class_path`` + ``init_args`` entry names (``default`` class when absent)."""
    from pkgutil import resolve_name

    spec = spec or {"class_path": default}
    return resolve_name(spec["class_path"])(**spec.get("init_args", {}))


def run_config(spec: RunSpec, run_dir: Path) -> dict[str, Any]:
    """The run's config, layered over the embedded default (its ``callbacks`` list replaces the default's)."""
    config: dict[str, Any] = {
        "seed_everything": spec.seed,
        "trainer": {
            "max_steps": spec.max_steps,
            "enable_progress_bar": False,
            "logger": {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                       "init_args": {"save_dir": str(run_dir), "name": "tb", "version": 0}},
            "callbacks": [
                {"class_path": "lit_gmc.callbacks.weight_sync.WeightSync"},
                {"class_path": "lit_gmc.callbacks.delays.DelayAccounting"},
                {"class_path": "lit_gmc.callbacks.diagnostics.Diagnostics",
                 "init_args": {"histogram_every_n_steps": 25}},
            ],
        },
        "checkpoint": {"dirpath": str(run_dir / "checkpoints"), "every_n_train_steps": spec.checkpoint_every,
                       "save_last": True, "save_top_k": -1},
        # The rule's own options at their defaults (GRPO: clip 0.2, seq-mean-token-mean) unless --aggregation holds
        # the aggregation fixed across rules; GMC's cap schedule if asked.
        "model": {"correction": {"class_path": rule_class_path(spec.method), "init_args": rule_options(spec)}},
        "data": {"schedule": suite_schedule(spec.delay), "group_size": spec.group_size, "seed": spec.seed},
    }  # fmt: skip
    for key, value in spec.overrides.items():
        section, *path = key.split(".")
        node = config.setdefault(section, {})
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return config


def config_digest(config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


class Manifest:
    """``OUT/manifest.json``: every run's parameters and status; written atomically under a lock."""

    def __init__(self, out: Path) -> None:
        self.path = out / "manifest.json"
        self.lock = threading.Lock()
        self.data = json.loads(self.path.read_text()) if self.path.exists() else {"invocations": [], "runs": {}}

    def update(self, name: str, **fields: Any) -> None:
        with self.lock:
            self.data["runs"].setdefault(name, {}).update(fields)
            self._write()

    def add_invocation(self, argv: list[str]) -> None:
        with self.lock:
            self.data["invocations"].append({"argv": argv, "started": time.strftime("%Y-%m-%d %H:%M:%S")})
            self._write()

    def _write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        staging = self.path.with_suffix(".json.tmp")
        staging.write_text(json.dumps(self.data, indent=2, sort_keys=True))
        os.replace(staging, self.path)


def child_env(parallel: int) -> dict[str, str]:
    """Environment of a run: split the cores between the parallel runs instead of oversubscribing them."""
    threads = str(max(1, (os.cpu_count() or 1) // parallel))
    return {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "PYTHONUNBUFFERED": "1"}


def execute(spec: RunSpec, out: Path, manifest: Manifest, args: argparse.Namespace) -> str:
    """Train (or resume) and evaluate one run; returns its final status."""
    run_dir = (out / "runs" / spec.name).resolve()
    config = run_config(spec, run_dir)
    digest = config_digest(config)
    config_path = run_dir / "config.json"
    if config_path.exists() and config_digest(json.loads(config_path.read_text())) != digest:
        raise ValueError(f"run {spec.name} exists in {run_dir} with a different config; use another --out or --tag")
    if (run_dir / "done.json").exists():
        manifest.update(spec.name, status="done")
        return "skipped"
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path.write_text(json.dumps(config, indent=2))
    command = [sys.executable, "-m", "lit_gmc", "fit", "--config", str(config_path)]
    if (run_dir / "checkpoints" / "last.ckpt").exists():
        command += ["--ckpt_path", "last"]
    manifest.update(spec.name, **asdict(spec), dir=str(run_dir), config_digest=digest, status="training",
                    command=" ".join(command))  # fmt: skip
    env = child_env(args.parallel)
    started = time.time()
    with open(run_dir / "train.log", "a") as log:
        code = subprocess.run(command, cwd=run_dir, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    train_seconds = time.time() - started
    if code != 0:
        manifest.update(spec.name, status="failed", returncode=code, train_seconds=train_seconds)
        return "failed"
    manifest.update(spec.name, status="evaluating", train_seconds=train_seconds)
    evaluate_cmd = [sys.executable, str(Path(__file__).resolve()), "evaluate", str(run_dir),
                    "--samples", str(args.eval_samples), "--cache-dir", str(out.resolve() / "eval_cache")]  # fmt: skip
    if args.eval_limit is not None:
        evaluate_cmd += ["--limit", str(args.eval_limit)]
    started = time.time()
    with open(run_dir / "eval.log", "a") as log:
        code = subprocess.run(evaluate_cmd, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    eval_seconds = time.time() - started
    if code != 0:
        manifest.update(spec.name, status="failed", returncode=code, eval_seconds=eval_seconds)
        return "failed"
    (run_dir / "done.json").write_text(json.dumps({"config_digest": digest, "train_seconds": train_seconds,
                                                   "eval_seconds": eval_seconds}))  # fmt: skip
    manifest.update(spec.name, status="done", returncode=0, eval_seconds=eval_seconds)
    return "done"


def run_grid(args: argparse.Namespace) -> int:
    out = Path(args.out)
    specs = expand_grid(args)
    if args.dry_run:
        for spec in specs:
            print(spec.name)
        return 0
    manifest = Manifest(out)
    manifest.add_invocation(["scripts/sweep.py", *sys.argv[1:]])
    statuses: dict[str, str] = {}
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        futures = {spec.name: pool.submit(execute, spec, out, manifest, args) for spec in specs}
        for name, future in futures.items():
            statuses[name] = future.result()
            print(f"{name}: {statuses[name]}", flush=True)
    failed = [n for n, s in statuses.items() if s == "failed"]
    counts = {s: list(statuses.values()).count(s) for s in sorted(set(statuses.values()))}
    print(f"{len(specs)} runs: " + ", ".join(f"{count} {status}" for status, count in counts.items()))
    if failed:
        print("failed (see their train.log / eval.log): " + ", ".join(failed), file=sys.stderr)
    return 1 if failed else 0


# --- held-out evaluation of a run's checkpoints ---------------------------------------------------------------


class TaskScorer:
    """``score_pairs`` over a task's own reward function (what ``evaluate_suites`` needs)."""

    def __init__(self, task) -> None:
        self.task = task

    def score_pairs(self, pairs: list[tuple[str, str]]) -> list[float]:
        return [self.task.score([text], answer)[0] for text, answer in pairs]


def checkpoint_steps(run_dir: Path) -> dict[int, Path | None]:
    """``step -> checkpoint``: step 0 (the initial actor, ``None``), the periodic checkpoints and ``last.ckpt``
    (the final weights when the run length is not a multiple of the checkpoint period)."""
    import torch

    steps: dict[int, Path | None] = {0: None}
    for path in (run_dir / "checkpoints").glob("*.ckpt"):
        match = re.search(r"step=(\d+)", path.name)
        if match:
            steps[int(match.group(1))] = path
    last = run_dir / "checkpoints" / "last.ckpt"
    if last.exists():
        steps.setdefault(int(torch.load(last, map_location="cpu", weights_only=False)["global_step"]), last)
    return dict(sorted(steps.items()))


def evaluate_run(
    run_dir: Path, samples: int, seed: int, cache_dir: Path | None = None, limit: int | None = None
) -> list[Path]:
    """Greedy and ``samples``-sample held-out accuracy of every checkpoint (and the initial actor, whose result
    is shared through ``cache_dir`` when given); writes ``run_dir/eval/step_<n>.json``, skipping existing ones.
    ``limit`` keeps only the first held-out prompts (for quick checks)."""
    import shutil

    import torch

    from lit_gmc.actor import load_actor
    from lit_gmc.callbacks.evaluation import Suite, evaluate_suites
    from lit_gmc.data.engines.hf import HFEngine

    config = json.loads((run_dir / "config.json").read_text())
    task_spec = config.get("data", {}).get("task")
    task_name = (task_spec or {}).get("class_path", "Addition").rpartition(".")[2]
    actor = config.get("model", {}).get("actor", "tiny")
    max_new_tokens = config.get("data", {}).get("max_new_tokens", 6)
    task = build_component(task_spec, "lit_gmc.data.tasks.addition.Addition")
    ks = tuple(k for k in (1, 2, 4, 8, 16) if k <= samples)
    prompts = list(task.test_prompts())[:limit]
    suite = Suite(*eval_suite_name(task_name), prompts, samples, ks)
    # Step 0 is the same initial actor in every run of a sweep: evaluate it once, keyed by what decides it.
    initial_key = config_digest(
        {"actor": actor, "task": task_name, "tokens": max_new_tokens, "n": samples, "seed": seed, "limit": limit}
    )
    initial = cache_dir / f"initial-{initial_key}.json" if cache_dir is not None else None
    written = []
    for step, ckpt in checkpoint_steps(run_dir).items():
        target = run_dir / "eval" / f"step_{step}.json"
        if target.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        if ckpt is None and initial is not None and initial.exists():
            shutil.copyfile(initial, target)
            written.append(target)
            continue
        model, tokenizer = load_actor(actor)
        if ckpt is not None:
            state = torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]
            model.load_state_dict({k.removeprefix("actor."): v for k, v in state.items() if k.startswith("actor.")})
        engine = HFEngine.from_model(model, tokenizer)
        results = evaluate_suites(engine, tokenizer, TaskScorer(task), [suite], max_new_tokens, seed)
        engine.close()
        target.write_text(json.dumps({"step": step, "version": step, **results}, indent=2))
        if ckpt is None and initial is not None:  # staged, so a parallel run never copies a half-written file
            initial.parent.mkdir(parents=True, exist_ok=True)
            staging = initial.with_suffix(f".{os.getpid()}.tmp")
            shutil.copyfile(target, staging)
            os.replace(staging, initial)
        written.append(target)
    return written


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    grid = sub.add_parser("run", help="run (or resume) a grid of runs")
    grid.add_argument("--out", required=True, help="sweep folder (manifest.json, runs/)")
    grid.add_argument(
        "--methods",
        nargs="+",
        default=["gmc", "tic", "grpo"],
        help="rules (--model.correction classes, any case: gmc tic grpo vcpo gac a3po cispo tis is)",
    )
    grid.add_argument("--delays", nargs="+", type=int, default=[0, 8, 32, 128], help="fixed delays D")
    grid.add_argument("--group-sizes", nargs="+", type=int, default=[8], help="G values")
    grid.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    grid.add_argument("--max-steps", type=int, required=True, help="updates per run (N)")
    grid.add_argument("--checkpoint-every", type=int, required=True, help="checkpoint (and evaluation) period")
    grid.add_argument(
        "--eps-schedule",
        default="constant",
        choices=["constant", "corollary1"],
        help="GMC's --model.correction.cap_schedule (GMC only)",
    )
    grid.add_argument(
        "--aggregation",
        default=None,
        choices=["seq_sum_over_T", "token_mean", "seq_mean_token_mean"],
        help="one loss aggregation for every rule (the paper's suites: seq_sum_over_T, 1/(T B G)); unset: each rule's "
        "authors' (added to the run names when set)",
    )
    grid.add_argument("--tag", default="", help="suffix of the run names (for variants made with --set)")
    grid.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                      help="extra config value for every run, e.g. optimizer.init_args.lr=1e-4")  # fmt: skip
    grid.add_argument("--parallel", type=int, default=2, help="runs at the same time")
    grid.add_argument("--eval-samples", type=int, default=8, help="samples per held-out prompt (avg@n, pass@k)")
    grid.add_argument("--eval-limit", type=int, default=None, help="only the first held-out prompts (quick checks)")
    grid.add_argument("--dry-run", action="store_true", help="print the run names and exit")
    one = sub.add_parser("evaluate", help="evaluate the checkpoints of one run folder")
    one.add_argument("run_dir")
    one.add_argument("--samples", type=int, default=8)
    one.add_argument("--seed", type=int, default=0)
    one.add_argument("--cache-dir", default=None, help="folder sharing the initial actor's evaluation across runs")
    one.add_argument("--limit", type=int, default=None, help="only the first held-out prompts")
    args = parser.parse_args(argv)
    if args.command == "run":
        problems = [f"--{name.replace('_', '-')} must be >= 1"
                    for name in ("max_steps", "checkpoint_every", "parallel", "eval_samples", "eval_limit")
                    if getattr(args, name) is not None and getattr(args, name) < 1]  # fmt: skip
        if args.max_steps % args.checkpoint_every:
            problems.append(f"--max-steps={args.max_steps} must be a multiple of --checkpoint-every="
                            f"{args.checkpoint_every} (the final weights must be checkpointed)")  # fmt: skip
        problems += [f"--delays: {d} must be >= 0" for d in args.delays if d < 0]
        problems += [f"--group-sizes: {g} must be >= 2" for g in args.group_sizes if g < 2]
        from lit_gmc.rules import registered

        rules = {name.lower() for name in registered()}
        problems += [
            f"--methods: {m} is not one of {' '.join(sorted(rules))}" for m in args.methods if m.lower() not in rules
        ]
        if args.eps_schedule != "constant" and any(m.lower() != "gmc" for m in args.methods):
            problems.append(f"--eps-schedule {args.eps_schedule} is GMC's cap schedule: use it with --methods gmc only")
        for item in args.set:
            try:
                key, _ = parse_override(item)
            except argparse.ArgumentTypeError as err:
                problems.append(str(err))
                continue
            if any(key == axis or key.startswith(f"{axis}.") for axis in GRID_KEYS):
                problems.append(f"--set {item!r}: {key} is a grid axis; use the matching sweep option")
        if problems:
            parser.error("; ".join(problems))
    elif args.samples < 1:
        parser.error("--samples must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "evaluate":
        cache = Path(args.cache_dir) if args.cache_dir else None
        for path in evaluate_run(Path(args.run_dir), args.samples, args.seed, cache, args.limit):
            print(path)
        return 0
    return run_grid(args)


if __name__ == "__main__":
    sys.exit(main())
