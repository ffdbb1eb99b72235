"""``lit-gmc estimate``: every rule's update measured against the true gradient, per rule x G x delay.

Two ways to get the policies: train ``theta_tau`` from the config's actor ``theta_b`` for each ``--delays`` entry
(the default: the tiny policy on the embedded default), or give two checkpoints of a run (``--behavior``,
``--current``, their delay from their updates or ``--delay``). The prompts are the task's training prompts whose reward
varies most under ``theta_b`` (``--prompts`` of ``--candidates``); the response space of each is every response of at
most ``--max-tokens`` tokens (``--space enumerated``), or the responses sampled from each policy (``--space
sampled``, where there are too many to enumerate: ``grad J / T`` is then itself estimated). Writes ``lab.json``
(everything), ``lab.csv`` (a row per rule x G x delay), ``lab.md`` (the table) and the figures (PNG and PDF) to
``--out``.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import random
import time
from pathlib import Path

import torch

from lit_gmc.errors import UserError

DEFAULT_DELAYS = (0, 2, 8, 32)
SWEEP_RULES = ("IS", "TIC", "GMC")
SWEEP_GROUP_SIZES = (2, 4, 8, 16, 32)


def parser() -> argparse.ArgumentParser:
    """The ``lit-gmc estimate`` argument parser."""
    p = argparse.ArgumentParser(prog="lit_gmc estimate", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--out", default="runs/estimator_lab", help="folder for the results (default: %(default)s)")
    p.add_argument("--config", action="append", default=None,
                   help="the run whose actor is theta_b and trains theta_tau (repeatable, as fit's; default: the "
                   "embedded configs/tiny.yaml)")  # fmt: skip
    p.add_argument("--delays", type=int, nargs="+", default=list(DEFAULT_DELAYS),
                   help="delays tau to train theta_tau for (default: %(default)s)")  # fmt: skip
    p.add_argument("--behavior", help="theta_b: a lit_gmc checkpoint, a transformers folder, a hub name or 'tiny'")
    p.add_argument("--current", help="theta: the same kinds, a later state of the same model")
    p.add_argument("--delay", type=int, help="tau between --behavior and --current (default: from their updates)")
    p.add_argument("--task", default="lit_gmc.data.tasks.addition.Addition",
                   help="the task class (import path) whose prompts and score are used (default: %(default)s)")
    p.add_argument("--rules", nargs="+", default=None,
                   help="rules by name or import path (default: every registered rule)")  # fmt: skip
    p.add_argument("--group-sizes", type=int, nargs="+", default=[2, 8],
                   help="G for every rule at every delay; G = 2 is also summed exactly (default: %(default)s)")
    p.add_argument("--sweep-rules", nargs="*", default=list(SWEEP_RULES),
                   help="rules measured over --sweep-group-sizes at --sweep-delay (default: %(default)s)")
    p.add_argument("--sweep-group-sizes", type=int, nargs="*", default=list(SWEEP_GROUP_SIZES),
                   help="(default: %(default)s)")
    p.add_argument("--sweep-delay", type=int, help="the delay of the group-size sweep (default: the largest)")
    p.add_argument("--aggregation", choices=("paper", "own"), default="paper",
                   help="paper: seq_sum_over_T for every rule (the paper's 1/(T B G), whose expectation is grad J / "
                   "T); own: each rule's authors' (default: %(default)s)")  # fmt: skip
    p.add_argument("--prompts", type=int, default=4, help="prompts (default: %(default)s)")
    p.add_argument("--candidates", type=int, default=24,
                   help="training prompts among which the --prompts of largest reward variance are taken")
    p.add_argument("--max-tokens", type=int, default=2, help="T: responses of at most T tokens (default: %(default)s)")
    p.add_argument("--space", choices=("enumerated", "sampled"), default="enumerated",
                   help="enumerated: every response, exact sums; sampled: responses drawn from each policy, grad J / T "
                   "itself a Monte-Carlo estimate (for spaces too large to enumerate) (default: %(default)s)")
    p.add_argument("--target-group", type=int, default=8,
                   help="sampled: the group size of the on-policy estimator of grad J / T (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default: %(default)s)")
    p.add_argument("--draws", type=int, default=1000,
                   help="groups drawn per prompt, G and delay (default: %(default)s)")
    p.add_argument("--batches", type=int, default=10, help="batches of the draws, for errors (default: %(default)s)")
    p.add_argument("--omit", type=float, default=1e-5,
                   help="sums run over the responses holding all but this much of each policy's mass "
                   "(default: %(default)s; 0: every response)")  # fmt: skip
    p.add_argument("--reward-bound", type=float, default=1.0, help="R, rewards lie in [0, R] (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    return p


def option_problems(args: argparse.Namespace) -> list[str]:
    """Every problem with the options that needs nothing loaded, one line each."""
    problems = []
    pair = (args.behavior is None, args.current is None)
    if pair[0] != pair[1]:
        problems.append("--behavior and --current go together")
    if args.delay is not None and args.behavior is None:
        problems.append("--delay is the delay between --behavior and --current: give those too")
    for name in ("prompts", "candidates", "max_tokens", "draws"):
        if getattr(args, name) < 1:
            problems.append(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    if args.batches < 3:
        problems.append(f"--batches {args.batches} must be >= 3 (the jackknife's errors need them)")
    if args.draws < args.batches:
        problems.append(f"--draws {args.draws} must be at least --batches {args.batches}")
    if args.candidates < args.prompts:
        problems.append(f"--candidates {args.candidates} must be at least --prompts {args.prompts}")
    if not 0 <= args.omit < 1:
        problems.append(f"--omit {args.omit} must be in [0, 1)")
    if any(d < 0 for d in args.delays) or (args.delay is not None and args.delay < 0):
        problems.append(f"--delays/--delay must be >= 0, got {args.delay if args.delay is not None else args.delays}")
    if any(g < 2 for g in (*args.group_sizes, *args.sweep_group_sizes, args.target_group)):
        problems.append("group sizes must be >= 2 (leave-one-out advantages need two responses)")
    if not (args.reward_bound > 0 and args.temperature > 0):
        problems.append("--reward-bound and --temperature must be > 0")
    return problems


def rule_classes(names: list[str] | None) -> dict[str, type]:
    """``name -> Correction subclass`` for names of registered rules or import paths."""
    from lit_gmc.corrections import Correction
    from lit_gmc.rules import registered

    known = registered()
    out = {}
    for name in names if names is not None else list(known):
        if name in known:
            out[name] = known[name]
            continue
        module, _, attr = name.rpartition(".")
        try:
            found = getattr(importlib.import_module(module), attr) if module else None
        except ImportError as err:
            raise UserError(f"--rules {name}: cannot import {module} ({err})") from err
        if not (inspect.isclass(found) and issubclass(found, Correction)):
            raise UserError(f"--rules {name}: not a registered rule ({', '.join(known)}) nor the import path of a "
                            "Correction subclass")  # fmt: skip
        out[name] = found
    return out


def build_rule(name: str, cls: type, aggregation: str):
    """``cls`` built with its defaults (and ``aggregation="seq_sum_over_T"`` when ``aggregation`` is ``paper``)."""
    try:
        return cls(aggregation="seq_sum_over_T") if aggregation == "paper" else cls()
    except Exception as err:
        raise UserError(f"--rules {name}: building it with its defaults failed: {err}") from err


def task_instance(path: str):
    """An instance of the task class at import path ``path``, built with no arguments."""
    module, _, attr = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)()
    except Exception as err:
        raise UserError(f"--task {path}: cannot build it ({err})") from err


def default_config() -> str:
    """The embedded default's config file, from the checkout or the installed package."""
    here = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
    return str(here if here.is_file() else Path("configs/tiny.yaml"))


def config_actor(config: list[str]) -> str:
    """The actor a fit config names (``model.actor``, the last file that sets it), ``tiny`` by default."""
    import yaml

    actor = "tiny"
    for path in config:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as err:
            raise UserError(f"--config {path}: cannot read it ({err})") from err
        actor = (data.get("model") or {}).get("actor", actor)
    return actor


def choose_prompts(task, behavior, args) -> list:
    """The ``--prompts`` training prompts of largest reward variance under ``theta_b`` among ``--candidates``.

    Each as ``(variance, space, behaviour log-probs)`` (enumerated) or ``(variance, (text, answer), None)`` (sampled:
    the mean reward of 64 samples).
    """
    from lit_gmc.lab.run import seeded
    from lit_gmc.lab.space import prompt_space, sample_responses, token_logprobs

    tokenizer = behavior.tokenizer
    prompts = [p for p in task.train_prompts()
               if len(tokenizer(p.answer, add_special_tokens=False)["input_ids"]) <= args.max_tokens]  # fmt: skip
    if len(prompts) < args.prompts:
        raise UserError(f"--max-tokens {args.max_tokens}: only {len(prompts)} training prompts of --task {args.task} "
                        f"have an answer that short, fewer than --prompts {args.prompts}")  # fmt: skip
    picked = random.Random(args.seed).sample(prompts, min(args.candidates, len(prompts)))
    scored = []
    for index, prompt in enumerate(picked):
        if args.space == "enumerated":
            space = prompt_space(prompt.text, prompt.answer, tokenizer, args.max_tokens, task.score)
            logprobs = token_logprobs(behavior.model, space, args.temperature)
            mean, item = float((logprobs.sum(-1).exp() * space.rewards).sum()), (space, logprobs)
        else:
            prompt_ids = torch.tensor(tokenizer(prompt.text, add_special_tokens=False)["input_ids"])
            ids, mask = sample_responses(behavior.model, prompt_ids, 64, args.max_tokens, tokenizer.eos_token_id,
                                         tokenizer.pad_token_id, seeded(args.seed, index), args.temperature)
            texts = tokenizer.batch_decode([row[m].tolist() for row, m in zip(ids, mask, strict=True)],
                                           skip_special_tokens=True)  # fmt: skip
            mean, item = sum(task.score(texts, prompt.answer)) / len(texts), ((prompt.text, prompt.answer), None)
        scored.append((mean * (args.reward_bound - mean), *item))
    scored.sort(key=lambda entry: -entry[0])
    return scored[: args.prompts]


class Clock:
    """Wall time of each phase of a run (``laps``, seconds), for ``lab.json`` and the benchmark."""

    def __init__(self) -> None:
        self.start = self.last = time.time()
        self.laps: dict[str, float] = {}

    def lap(self, name: str) -> None:
        """Record the time since the last lap under ``name``."""
        now = time.time()
        self.laps[name] = round(now - self.last, 1)
        self.last = now

    def total(self) -> float:
        """Seconds since the clock started."""
        return round(time.time() - self.start, 1)


def policies(args: argparse.Namespace, out: Path) -> tuple:
    """``(theta_b, {tau: theta_tau or its checkpoint}, source)``: the two checkpoints given, or those trained."""
    from lit_gmc.lab.policies import check_pair, load_policy, trained_policies

    if args.behavior is not None:
        behavior, current = load_policy(args.behavior, "--behavior"), load_policy(args.current, "--current")
        return behavior, {check_pair(behavior, current, args.delay): current}, {"behavior": args.behavior,
                                                                                 "current": args.current}
    config = args.config or [default_config()]
    delays = sorted(set(args.delays))
    checkpoints = trained_policies(config, delays, out / "policies")
    behavior = load_policy(config_actor(config), "--config's model.actor")
    currents = {tau: behavior if tau == 0 else checkpoints[tau] for tau in delays}
    return behavior, currents, {"config": config, "trained": {str(t): str(p) for t, p in checkpoints.items()}}


def main(argv: list[str] | None = None) -> None:
    """Run ``lit-gmc estimate`` on ``argv`` (default: the command line) and write its report to ``--out``."""
    args = parser().parse_args(argv)
    problems = option_problems(args)
    if problems:
        raise UserError("; ".join(problems))
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    from rich.progress import Progress

    from lit_gmc.lab.policies import load_policy
    from lit_gmc.lab.report import write_report
    from lit_gmc.lab.run import Cell, Settings, measure_delay
    from lit_gmc.lab.sampled import measure_delay_sampled

    out = Path(args.out)
    rules = rule_classes(args.rules)
    sweep = rule_classes(args.sweep_rules) if args.sweep_rules else {}
    task = task_instance(args.task)
    clock = Clock()
    behavior, currents, source = policies(args, out)
    delays = sorted(currents)
    clock.lap("policies")
    sweep_delay = args.sweep_delay if args.sweep_delay is not None else max(delays)
    if sweep and sweep_delay not in delays:
        raise UserError(f"--sweep-delay {sweep_delay} is not one of the delays measured ({delays})")
    chosen = choose_prompts(task, behavior, args)
    spaces, behavior_logprobs = [item for _, item, _ in chosen], [lp for _, _, lp in chosen]
    clock.lap("prompts")
    settings = Settings(draws=args.draws, batches=args.batches, omit=args.omit, max_tokens=args.max_tokens,
                        target_group=args.target_group, temperature=args.temperature, reward_bound=args.reward_bound,
                        seed=args.seed)  # fmt: skip
    records, cells_out = [], []
    with Progress(transient=False) as progress:
        bar = progress.add_task("estimator lab", total=len(delays) * len(spaces))
        for tau in delays:
            current = currents[tau]
            policy = current if not isinstance(current, Path) else load_policy(str(current), f"theta_{tau}")
            grid = {**rules, **(sweep if tau == sweep_delay else {})}
            cells = [Cell(name, build_rule(name, cls, args.aggregation), g, exact=g == 2) for name, cls in grid.items()
                     for g in sorted({*(args.group_sizes if name in rules else ()),
                                      *(args.sweep_group_sizes if tau == sweep_delay and name in sweep else ())})]
            advance = lambda text: progress.update(bar, advance=1, description=text)  # noqa: E731
            if args.space == "enumerated":
                record, cell_records = measure_delay(policy.model, spaces, behavior_logprobs, tau, cells, settings,
                                                     advance)  # fmt: skip
            else:
                record, cell_records = measure_delay_sampled(behavior.model, policy.model, spaces, behavior.tokenizer,
                                                             task.score, tau, cells, settings, advance)  # fmt: skip
            records.append(record)
            cells_out += cell_records
            clock.lap(f"delay {tau}")
    meta = {"command": ["lit-gmc", "estimate", *(argv or [])], "source": source, "settings": vars(args),
            "seconds": clock.total(), "phases": clock.laps,
            "parameters": sum(p.numel() for p in behavior.model.parameters())}
    paths = write_report(out, meta, records, cells_out, sweep_delay)
    print(f"estimator lab: {len(cells_out)} measurements in {meta['seconds']} s -> {', '.join(map(str, paths))}")
