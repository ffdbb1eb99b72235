"""Step benchmark: seconds per update of ``python -m lit_gmc fit`` against a bare PyTorch + transformers loop.

The bare loop does the work of one update of the tiny job with nothing around it: the warm-started tiny actor
(``load_actor("tiny")``), 8 Addition prompts x 8 samples of <= 6 new tokens sampled as ``HFEngine`` samples them (a
behaviour copy of the actor, ``generate`` with ``top_k=0``, behaviour log-probs from the processed scores, seed
``seed * 1_000_003 + launch``), the task's reward, ``response_logprobs``, the ``grpo`` correction and
``aggregate_loss``, ``clip_grad_norm_``, an AdamW step with the cosine schedule, and the weights copied back into
the behaviour copy. It logs nothing. With ``--schedule Sync`` it computes exactly what lit_gmc computes, and the
script checks that the per-update losses agree. (With ``FixedDelay`` lit_gmc trains on batches ``delay`` updates
old; the work per update is the same, the values differ.)

lit_gmc's own update is ``fit`` run in this process through ``GMCCLI`` on the embedded default (``configs/tiny.yaml``:
its callbacks, logger and progress bar) with ``--model.correction grpo``, the chosen schedule and one torch thread,
logging to a temporary folder. ``--compare-logger`` adds lit_gmc with its former logger (Lightning's
``TensorBoardLogger`` flushed after every ``log_metrics`` call).

The two alternate update by update, so that both see the same load on a busy machine: a callback runs one update
of the bare loop at the top of every ``on_train_batch_start``, outside lit_gmc's timed window. lit_gmc's update is
the interval from there to the next ``on_train_batch_start`` (one training step, its callbacks and the fetch of the
next batch); start-up, the first ``--warmup`` updates and, under ``FixedDelay``, the draining updates are left out.
The bare update is timed until its temporaries (``generate``'s scores, the update's tensors) are freed, as lit_gmc's
window holds the freeing of its own (phase ``release``; before the fourth round its clock stopped just before, which
left ~0.25 ms an update out of the bare side).
Each ``fit`` gives the median of the per-update ratios lit_gmc / bare (and the median seconds of each); the script
prints the median over ``--reps`` fits. Times are process CPU time by default (``--clock cpu``: steadier than wall
time when other processes share the cores) and wall time alongside. Single updates' ratios scatter by several per
cent, so at ``--steps 40`` (34 steady updates) the fits of one run spread over ~0.99-1.07 on the 2-core machine of
``docs/performance.md``, and at ``--steps 200`` over ~0.01-0.03; to resolve changes of under 1%, run longer fits
and profile only a few of them (``--phase-reps``).

The per-phase breakdown comes from separate, instrumented fits: wrappers installed around library functions (no
library code changes; ~75 wrapped calls an update) charge each phase with its own time, less that of the wrapped
calls nested in it, and "Lightning loop" is what no wrapper saw (``--lightning-phases`` splits some of it off:
Lightning's hook dispatch to the module and strategy, its data fetcher, logger connector, ``training_step`` keyword
arguments and ``batch_to_device``; its dispatch to the callbacks stays in the rest). Phases are means over the
steady updates (they add up to the mean update) and medians over repetitions. The wrappers slow an instrumented fit
down by a few per cent (the script prints both fits' ratios), so read the small phases as upper bounds.

    python scripts/bench_step.py [--reps 5] [--phase-reps N] [--steps 40] [--warmup 5] [--schedule Sync|FixedDelay]
                                 [--delay 8] [--clock cpu|wall] [--compare-logger] [--lightning-phases]
                                 [--fit-args "..."]
                                 [--json out.json] [--plot [PNG]]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import io
import json
import math
import os
import shlex
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.loops.fetchers import _PrefetchDataFetcher
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.trainer import call as trainer_call
from lightning.pytorch.trainer.connectors.logger_connector.logger_connector import _LoggerConnector
from lightning.pytorch.utilities import rank_zero_only
from torch.utils.data.dataloader import _BaseDataLoaderIter

from lit_gmc import objectives as O
from lit_gmc.actor import load_actor
from lit_gmc.batch import RolloutBatch
from lit_gmc.callbacks import diagnostics as diagnostics_module
from lit_gmc.cli import GMCCLI
from lit_gmc.corrections import CORRECTIONS, PolicyTerms
from lit_gmc.data import datamodule as datamodule_module
from lit_gmc.data.datamodule import RolloutDataModule
from lit_gmc.data.engines import HFEngine
from lit_gmc.data.tasks import Addition, PromptStream
from lit_gmc.eps_schedules import ConstantEps
from lit_gmc.logprobs import response_logprobs
from lit_gmc.module import GMCModule
from lit_gmc.tblog import read_scalars

B, G, T, SEED, LR, EPS, MAX_NORM = 8, 8, 6, 0, 2e-4, 0.2, 1.0  # configs/tiny.yaml with --model.correction grpo
# The groups of the summary table and the plot; a phase "a: b" falls in group a's unless named itself.
GROUPS = {"generate": "generate", "score": "score", "collate": "collate", "schedule": "collate",
          "log-probs forward": "log-probs forward", "loss": "loss", "backward": "backward", "stats": "stats",
          "learner other": "stats", "learner": "stats", "learner: zero_grad": "optimizer",
          "learner: lr scheduler step": "optimizer", "clip": "optimizer", "optimizer": "optimizer",
          "weight sync": "weight sync", "logging": "logging", "callback": "callbacks",
          "Lightning loop": "Lightning loop", "Lightning": "Lightning loop", "release": "release"}  # fmt: skip
COLOURS = {"generate": "#1f77b4", "score": "#aec7e8", "collate": "#ff7f0e", "log-probs forward": "#2ca02c",
           "loss": "#98df8a", "backward": "#d62728", "stats": "#ff9896", "optimizer": "#9467bd",
           "weight sync": "#c5b0d5", "logging": "#e377c2", "callbacks": "#bcbd22",
           "Lightning loop": "#7f7f7f", "release": "#dbdb8d"}  # fmt: skip
VARIANTS = {"lit": "lit_gmc", "lit_flush": "lit_gmc, logger flushed every call (before)"}


def group(phase: str) -> str:
    """The summary group of a timed phase."""
    return GROUPS.get(phase, GROUPS.get(phase.split(":")[0], phase))


# ----------------------------------------------------------------------------------------------- the bare loop


def sample(behaviour, tok, prompts, launch: int):
    """HFEngine's sampling: ``G`` responses per prompt, their behaviour log-probs and the prompt batch."""
    texts = [p.text for p in prompts]
    enc = tok(texts, add_special_tokens=False, padding=True, padding_side="left", return_tensors="pt")
    with torch.no_grad():
        torch.default_generator.manual_seed(SEED * 1_000_003 + launch)  # as HFEngine seeds (seed_sampling)
        out = behaviour.generate(
            **enc, max_new_tokens=T, do_sample=True, temperature=1.0, top_p=1.0, top_k=0, num_return_sequences=G,
            output_scores=True, return_dict_in_generate=True, pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )  # fmt: skip
    tokens = out.sequences[:, enc.input_ids.shape[1] :]  # (N, L)
    behav = torch.stack(out.scores, 1).log_softmax(-1).gather(-1, tokens[..., None])[..., 0]  # (N, L)
    return enc, out.sequences, tokens, behav


class BareLoop:
    """The bare loop, one update per :meth:`step`, planned for ``steps`` updates (the cosine schedule's length)."""

    NAMES = ("generate", "score", "collate", "log-probs forward", "loss", "backward", "clip", "optimizer",
             "weight sync")  # fmt: skip

    def __init__(self, steps: int, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.model, self.tok = load_actor("tiny")
        self.model.train()
        self.behaviour = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=LR, betas=(0.9, 0.999), weight_decay=0.0)
        cosine = lambda s: 0.5 * (1.0 + math.cos(math.pi * min(1.0, s / steps)))  # noqa: E731
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, cosine)
        self.task = Addition()
        self.stream = PromptStream(self.task.train_prompts(), seed=SEED)
        self.launch = 0
        self.times: list[float] = []  # by clock
        self.walls: list[float] = []
        self.phases: list[dict[str, float]] = []
        self.losses: list[float] = []

    def step(self) -> None:
        """One update, timed up to the release of its temporaries (as lit_gmc's window includes its own)."""
        wall, start = time.perf_counter(), self.clock()
        marks = self._update()
        end = self.clock()  # after _update's locals (generate's scores, the update's tensors) are freed
        self.times.append(end - start)
        self.walls.append(time.perf_counter() - wall)
        phases = {name: marks[i + 1] - marks[i] for i, name in enumerate(self.NAMES)}
        self.phases.append({**phases, "release": end - marks[-1] + marks[0] - start})

    def _update(self) -> list[float]:
        """Sample, score, collate, log-probs, loss, backward, clip, AdamW, weights to the behaviour copy.

        Returns the clock at the start and at the end of each phase of :attr:`NAMES`.
        """
        t, tok = [self.clock()], self.tok
        prompts = self.stream.take(B)
        enc, sequences, tokens, behav = sample(self.behaviour, tok, prompts, self.launch)
        self.launch += 1
        t.append(self.clock())
        texts = tok.batch_decode(tokens, skip_special_tokens=True)
        rewards = [r for b, p in enumerate(prompts) for r in self.task.score(texts[b * G : (b + 1) * G], p.answer)]
        rewards = torch.tensor(rewards)  # (N,)
        t.append(self.clock())
        is_eos = tokens == tok.eos_token_id
        mask = (is_eos.long().cumsum(-1) - is_eos.long()) == 0  # (N, L): up to and including the first EOS
        width = enc.input_ids.shape[1]
        input_ids = torch.cat([sequences[:, :width], tokens.masked_fill(~mask, tok.pad_token_id)], 1)  # (N, P + L)
        attention = torch.cat([enc.attention_mask.bool().repeat_interleave(G, 0), mask], 1)  # (N, P + L)
        behav = behav.masked_fill(~mask, 0.0)
        t.append(self.clock())
        logprobs, _ = response_logprobs(self.model, input_ids, attention, width)  # (N, L)
        t.append(self.clock())
        terms = PolicyTerms(logprobs, behav, mask, rewards, torch.zeros(B * G, dtype=torch.long), G)
        token_loss = CORRECTIONS["grpo"].fn(terms, EPS).token_loss
        loss = O.aggregate_loss(token_loss, mask, "seq_mean_token_mean", max_length=T, total_sequences=B * G,
                                total_tokens=int(mask.sum()))  # fmt: skip
        t.append(self.clock())
        loss.backward()
        t.append(self.clock())
        torch.nn.utils.clip_grad_norm_(self.params, MAX_NORM)
        t.append(self.clock())
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        t.append(self.clock())
        with torch.no_grad():
            for target, source in zip(self.behaviour.parameters(), self.model.parameters(), strict=True):
                target.copy_(source)
        t.append(self.clock())
        self.losses.append(float(loss.detach()))
        return t


# ------------------------------------------------------------------------------------- lit_gmc, instrumented


class Phases:
    """Exclusive time per phase and per update window, charged by wrappers around library functions."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.windows: list[dict[str, float]] = []  # window k: from on_train_batch_start k to k + 1
        self.stack: list[float] = []  # time of the wrapped calls nested in each open call
        self.paused = False  # while the bare loop runs (it calls some wrapped torch methods too)

    def wrap(self, fn: Callable, label: str) -> Callable:
        """``fn``, charging its own time (less nested wrapped calls) to ``label``."""

        @functools.wraps(fn)  # keeps the signature, which the CLI's protocol checks read
        def timed(*args, **kwargs):
            if self.paused:
                return fn(*args, **kwargs)
            self.stack.append(0.0)
            start = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = self.clock() - start
                nested = self.stack.pop()
                if self.windows:
                    self.windows[-1][label] += elapsed - nested
                if self.stack:
                    self.stack[-1] += elapsed

        return timed

    @contextlib.contextmanager
    def patched(self, targets: list[tuple[object, str, str]]) -> Iterator[None]:
        """Wrap ``owner.name`` as ``label`` for each ``(owner, name, label)``, and restore them on exit."""
        saved = [(owner, name, vars(owner).get(name)) for owner, name, _ in targets]
        try:
            for owner, name, label in targets:
                setattr(owner, name, self.wrap(getattr(owner, name), label))
            yield
        finally:
            for owner, name, original in saved:
                if original is None:  # inherited: drop the wrapper to expose the base class's method again
                    delattr(owner, name)
                else:
                    setattr(owner, name, original)


LIBRARY_PHASES = [
    (HFEngine, "generate", "generate"),
    (RolloutDataModule, "_generate", "score"),  # decode + reward, around the engine's generate
    (datamodule_module, "collate_groups", "collate"),
    (RolloutDataModule, "next_share", "schedule"),
    (GMCModule, "training_step", "learner other"),  # what the wrappers below leave of the training step
    (pl.LightningModule, "optimizers", "learner: optimizers() and lr_schedulers()"),
    (pl.LightningModule, "lr_schedulers", "learner: optimizers() and lr_schedulers()"),
    (torch.optim.Optimizer, "zero_grad", "learner: zero_grad"),
    (torch.optim.lr_scheduler.LRScheduler, "step", "learner: lr scheduler step"),
    (RolloutBatch, "groups_slice", "learner: micro-batch slicing"),
    (ConstantEps, "next_eps", "learner: eps schedule"),
    (GMCModule, "forward", "log-probs forward"),
    (GMCModule, "micro_batch_loss", "loss"),
    (pl.LightningModule, "manual_backward", "backward"),
    (GMCModule, "collect_stats", "stats"),
    (GMCModule, "clip_and_measure", "clip"),
    (LightningOptimizer, "step", "optimizer"),
    (GMCModule, "log_step", "logging: log_step"),
    (pl.LightningModule, "log", "logging: self.log"),
    (diagnostics_module, "step_scalars", "callback: Diagnostics.step_scalars"),
]
# --lightning-phases: Lightning's own calls around the step, charged apart from the rest of "Lightning loop". Its
# dispatch of callback hooks is not among them: the bare update runs inside that dispatch (in this script's hook).
LIGHTNING_PHASES = [
    (trainer_call, "_call_lightning_module_hook", "Lightning: module hook dispatch"),
    (trainer_call, "_call_strategy_hook", "Lightning: strategy hook dispatch"),
    (_PrefetchDataFetcher, "__next__", "Lightning: data fetcher"),
    (_BaseDataLoaderIter, "__next__", "Lightning: torch DataLoader"),
    (_LoggerConnector, "on_batch_start", "Lightning: logger connector"),
    (_LoggerConnector, "on_batch_end", "Lightning: logger connector"),
    (_LoggerConnector, "update_train_step_metrics", "Lightning: logger connector"),
    (_TrainingEpochLoop, "_build_kwargs", "Lightning: training_step kwargs"),
    (Strategy, "batch_to_device", "Lightning: batch_to_device"),
]
HOOKS = ("on_train_batch_start", "on_train_batch_end", "on_before_backward", "on_after_backward",
         "on_before_optimizer_step", "on_before_zero_grad")  # fmt: skip


class StepClock(pl.Callback):
    """Times lit_gmc's update windows, runs a bare update before each, and (``instrument``) wraps loggers and hooks."""

    def __init__(self, phases: Phases, bare: BareLoop, instrument: bool) -> None:
        self.phases, self.bare, self.instrument = phases, bare, instrument
        self.starts: list[tuple[float, float]] = []  # (clock, wall) at the start of each window
        self.ends: list[tuple[float, float]] = []  # and at its end
        self.undo: list[Callable[[], None]] = []

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not self.instrument:
            return
        for logger in trainer.loggers:
            self._wrap(logger, "log_metrics", "logging: logger write")
            self._wrap(logger.experiment, "add_scalar", "logging: logger write")  # direct writes of callbacks
            self._wrap(logger.experiment, "flush", "logging: logger flush")
            self._wrap(logger.experiment, "add_histogram", "logging: histograms")
        for callback in trainer.callbacks:
            if callback is not self:
                name = type(callback).__name__
                for hook in HOOKS:
                    self._wrap(callback, hook, "weight sync" if name == "WeightSync" else f"callback: {name}")

    def _wrap(self, obj: object, name: str, label: str) -> None:
        setattr(obj, name, self.phases.wrap(getattr(obj, name), label))
        self.undo.append(lambda: delattr(obj, name))

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for undo in self.undo:
            undo()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.starts:
            self.ends.append((self.phases.clock(), time.perf_counter()))
        self.phases.paused = True
        self.bare.step()
        self.phases.paused = False
        self.starts.append((self.phases.clock(), time.perf_counter()))
        self.phases.windows.append(defaultdict(float))


class FlushEveryCallLogger(TensorBoardLogger):
    """``lit_gmc.loggers.DurableTensorBoardLogger`` as it was: the stock writer, flushed after every call."""

    @rank_zero_only
    def log_metrics(self, metrics, step=None) -> None:
        super().log_metrics(metrics, step)
        self.experiment.flush()


def lit_run(steps: int, schedule: list[str], workdir: Path, clock: Callable, instrument: bool, logger: str | None,
            fit_args: Sequence[str] = (), lightning_phases: bool = False):  # fmt: skip
    """``fit`` in this process with a bare update before each of its updates; ``(lit windows, bare loop)``.

    The windows are ``(clock seconds, wall seconds, {phase: clock seconds})`` of the updates but the last.
    ``logger``: a ``class_path`` replacing the embedded default's logger class (same ``init_args``).
    ``fit_args``: more ``fit`` options, after the others. ``lightning_phases``: also time Lightning's own calls.
    """
    phases = Phases(clock)
    bare = BareLoop(steps, clock)
    timer = StepClock(phases, bare, instrument)
    args = ["fit", "--model.correction", "grpo", *schedule, "--trainer.max_steps", str(steps), "--torch_num_threads",
            "1", *(["--trainer.logger.class_path", logger] if logger else []),
            "--trainer.logger.init_args.save_dir", str(workdir), "--trainer.default_root_dir", str(workdir),
            *fit_args]  # fmt: skip
    out = io.StringIO()  # the progress bar and Lightning's messages, as in a run whose output goes to a file
    targets = [*LIBRARY_PHASES, *(LIGHTNING_PHASES if lightning_phases else [])] if instrument else []
    with phases.patched(targets), contextlib.redirect_stderr(out):
        with contextlib.redirect_stdout(out):
            GMCCLI(args=args, trainer_defaults={"callbacks": [timer]})
    windows = []
    for (c0, w0), (c1, w1), window in zip(timer.starts, timer.ends, phases.windows, strict=False):
        windows.append((c1 - c0, w1 - w0, {**window, "Lightning loop": c1 - c0 - sum(window.values())}))
    return windows, bare


# ----------------------------------------------------------------------------------------------- the driver


def summarise(times: list[float], walls: list[float], phases: list[dict[str, float]]) -> dict:
    """Median seconds per update (by the clock, and wall), and each phase's mean seconds."""
    names = dict.fromkeys(name for p in phases for name in p)
    return {"median_s": statistics.median(times), "mean_s": statistics.mean(times),
            "wall_median_s": statistics.median(walls),
            "phases": {name: sum(p.get(name, 0.0) for p in phases) / len(phases) for name in names}}  # fmt: skip


def paired(windows: list, bare: BareLoop, keep: range) -> dict:
    """lit_gmc's and the bare loop's summaries over ``keep``, and the medians of their per-update ratios."""
    lit = summarise([windows[k][0] for k in keep], [windows[k][1] for k in keep], [windows[k][2] for k in keep])
    base = summarise([bare.times[k] for k in keep], [bare.walls[k] for k in keep], [bare.phases[k] for k in keep])
    lit["ratio"] = statistics.median(windows[k][0] / bare.times[k] for k in keep)
    lit["wall_ratio"] = statistics.median(windows[k][1] / bare.walls[k] for k in keep)
    return {"lit": lit, "bare": base}


def parse_args() -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--reps", type=int, default=5, help="fits of each lit_gmc variant, alternated (each also profiled once)")
    add("--phase-reps", type=int, help="profile only the first this many repetitions (default: all); a "
        "profiled fit takes as long as a timed one, so this leaves time for more, longer timed fits")  # fmt: skip
    add("--steps", type=int, default=40, help="updates per fit")
    add("--warmup", type=int, default=5, help="first updates of each fit left out")
    add("--schedule", choices=["Sync", "FixedDelay"], default="Sync")
    add("--delay", type=int, default=8, help="FixedDelay's delay (its draining updates are left out)")
    add("--clock", choices=["cpu", "wall"], default="cpu", help="process CPU time or wall time (both are printed)")
    add("--compare-logger", action="store_true", help="also run lit_gmc with its former, flush-every-call logger")
    add("--fit-args", default="", help="more fit options for lit_gmc, one shell-quoted string (e.g. to leave out "
        "callbacks: \"--trainer.callbacks '[]'\"); the loss check is skipped when nothing logs train/loss")  # fmt: skip
    add("--lightning-phases", action="store_true", help="in the instrumented fits, also time Lightning's own calls "
        "around the step (hook dispatch to the module and strategy, the data fetcher, the logger connector, ...), "
        "each charged apart from the rest of 'Lightning loop'")  # fmt: skip
    add("--json", type=Path, help="write the figures here")
    add("--plot", nargs="?", const=Path("docs/figures/performance_phases.png"), type=Path,
        help="save a bar chart of ms/update per phase (default docs/figures/performance_phases.png)")  # fmt: skip
    args = parser.parse_args()
    if args.phase_reps is not None and args.phase_reps < 1:
        parser.error(f"--phase-reps={args.phase_reps}: the phase tables need at least one profiled fit")
    return args


def main() -> None:
    """Alternate the variants, print the medians, the ratios and the phase tables; optionally save and plot."""
    args = parse_args()
    torch.set_num_threads(1)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    schedule, draining = ["--data.schedule", args.schedule], 0
    if args.schedule == "FixedDelay":
        schedule, draining = [*schedule, "--data.schedule.delay", str(args.delay)], args.delay
    # Window k holds the fetch of batch k + 1: keep the windows whose fetch generated (not draining).
    keep = range(args.warmup, args.steps - 1 - draining)
    variants = ["lit", *(["lit_flush"] if args.compare_logger else [])]
    fit_args = shlex.split(args.fit_args)
    kinds = ("", "_bare", "_phases", "_phases_bare")  # timed lit_gmc, its bare loop, and the same when instrumented
    results: dict = {f"{name}{kind}": [] for name in variants for kind in kinds}
    results.update(load=[os.getloadavg()[0]], args={k: str(v) for k, v in vars(args).items()})
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for name in variants:
                logger = f"{__name__}.FlushEveryCallLogger" if name == "lit_flush" else None
                profiled = args.phase_reps is None or rep < args.phase_reps
                for instrument in (False, True)[: 1 + profiled]:
                    workdir = Path(tmp) / f"{name}{rep}{'_phases' * instrument}"
                    windows, bare = lit_run(args.steps, schedule, workdir, clock, instrument, logger, fit_args,
                                            args.lightning_phases)
                    both, kind = paired(windows, bare, keep), "_phases" if instrument else ""
                    results[f"{name}{kind}"].append(both["lit"])
                    results[f"{name}{kind}_bare"].append(both["bare"])
                checked = rep == 0 and args.schedule == "Sync" and any(workdir.rglob("events.out.tfevents.*"))
                logged = read_scalars(workdir) if checked else {}
                if "train/loss" in logged:
                    losses = [value for _, value in logged["train/loss"]]
                    gap = max(abs(a - b) for a, b in zip(losses, bare.losses, strict=True))
                    results[f"max_loss_gap_{name}"] = gap
                    print(f"same math: max |loss({name}) - loss(bare)| over {args.steps} updates = {gap:.3g}")
            ratios = ", ".join(f"{name} {results[name][-1]['ratio']:.3f}x bare" for name in variants)
            print(f"rep {rep} ({args.clock}): {ratios}  (load {os.getloadavg()[0]:.2f})", flush=True)
    results["load"].append(os.getloadavg()[0])
    report(results, variants, args.clock)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if args.plot:
        plot(results, variants, args.plot, args.clock)


def phase_ms(reps: list[dict], grouped: bool = False) -> dict[str, float]:
    """Median over repetitions of each phase's mean ms/update (of each group's, when ``grouped``)."""
    per_rep = []
    for rep in reps:
        out: dict[str, float] = defaultdict(float)
        for name, seconds in rep["phases"].items():
            out[group(name) if grouped else name] += seconds * 1e3
        per_rep.append(out)
    names = dict.fromkeys(name for out in per_rep for name in out)
    return {name: statistics.median(out.get(name, 0.0) for out in per_rep) for name in names}


def report(results: dict, variants: list[str], clock: str) -> None:
    """Print the medians and ratios (by the clock and wall), then the phase tables."""
    print()
    results["summary"] = {}
    for name in variants:
        lit, bare = results[name], results[f"{name}_bare"]
        summary = {f"{clock}_ratio": statistics.median(r["ratio"] for r in lit),
                   "wall_ratio": statistics.median(r["wall_ratio"] for r in lit),
                   f"{clock}_s": statistics.median(r["median_s"] for r in lit),
                   f"bare_{clock}_s": statistics.median(r["median_s"] for r in bare),
                   "wall_s": statistics.median(r["wall_median_s"] for r in lit),
                   "bare_wall_s": statistics.median(r["wall_median_s"] for r in bare)}  # fmt: skip
        results["summary"][name] = summary
        print(f"{VARIANTS[name]}: {summary[f'{clock}_s']:.4f} s/update vs bare {summary[f'bare_{clock}_s']:.4f} "
              f"({clock}), {summary['wall_s']:.4f} vs {summary['bare_wall_s']:.4f} (wall)")  # fmt: skip
        each = {key: ", ".join(f"{r[key]:.3f}" for r in lit) for key in ("ratio", "wall_ratio")}
        print(f"  ratio to bare, median of per-update ratios: {clock} {summary[f'{clock}_ratio']:.3f} "
              f"[{each['ratio']}], wall {summary['wall_ratio']:.3f} [{each['wall_ratio']}]")  # fmt: skip
        instrumented = statistics.median(r["ratio"] for r in results[f"{name}_phases"])
        print(f"  (the instrumented fits: {clock} {instrumented:.3f})")
    print(f"load average (1 min) before/after: {results['load'][0]:.2f} / {results['load'][1]:.2f}")
    print("phases: from the instrumented fits of lit_gmc, and of the bare loop alternating with it (lit_gmc's "
          "include the wrappers' cost)")  # fmt: skip
    profiled = [key for name in variants for key in (f"{name}_phases_bare", f"{name}_phases")]
    heads = ["bare", "lit_gmc", "bare", "before"][: len(profiled)]  # each lit_gmc variant beside its own bare loop
    for grouped in (True, False):
        tables = [phase_ms(results[name], grouped) for name in profiled]
        names = list(dict.fromkeys(key for table in tables for key in table))
        print(f"\n{'group' if grouped else 'phase'} ({clock} ms)".ljust(44) + "".join(f"{n:>16}" for n in heads))
        for key in names:
            print(f"{key:<44}" + "".join(f"{table.get(key, 0.0):>16.2f}" for table in tables))
        means = [statistics.median(r["mean_s"] for r in results[name]) * 1e3 for name in profiled]
        print(f"{'total (mean)':<44}" + "".join(f"{mean:>16.2f}" for mean in means))


def plot(results: dict, variants: list[str], path: Path, clock: str) -> None:
    """Horizontal stacked bars of ms/update per phase group: the bare loop and each lit_gmc variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = []
    for name in variants:  # each variant beside the bare updates that alternated with it
        partner = "lit_gmc" if name == "lit" else "lit_gmc before"
        rows += [(f"bare loop (with {partner})", f"{name}_phases_bare", None), (VARIANTS[name], f"{name}_phases", name)]
    fig, ax = plt.subplots(figsize=(9, 1.4 + 0.55 * len(rows)))
    for y, (_, key, name) in enumerate(rows):
        left, widths = 0.0, phase_ms(results[key], grouped=True)
        for part, colour in COLOURS.items():
            ax.barh(y, widths.get(part, 0.0), left=left, color=colour, label=part if y == 0 else None)
            left += widths.get(part, 0.0)
        ratio = "" if name is None else f"; {results['summary'][name][f'{clock}_ratio']:.3f}x bare"
        ax.text(left + 0.5, y, f"{left:.1f} ms{ratio}", va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), [label for label, _, _ in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, ax.get_xlim()[1] * 1.25)
    ax.set_xlabel(f"{'CPU' if clock == 'cpu' else 'wall'} ms per update (phase means; ratio: median per-update ratio)")
    ax.legend(ncol=6, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.25 - 0.3 / len(rows)))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
