"""Step benchmark: lit_gmc's update against a bare PyTorch loop doing the same forward, backward and AdamW step.

Both sides train on the same fixed batches (random token ids, behaviour log-probs and rewards, seeded), so the
comparison is the learner's update alone: no generation, no weight sync (at the target scale both belong to the
rollout engine, the same code on either side).

- lit_gmc: ``GMCModule`` as ``python -m lit_gmc fit`` builds it (``GMCCLI`` on the embedded default, with the
  shape's actor and sizes), trained by a Lightning ``Trainer`` with the default config's learner callbacks
  (``DelayAccounting``, ``Diagnostics``), its TensorBoard logger (to a temporary folder) and the bar, no
  checkpoints. One update is the interval between two ``on_train_batch_end`` calls: the next batch's fetch, the
  training step (log-probs, the rule, diagnostics, backward, clipping, AdamW, LR schedule), every callback and
  the logging.
- bare: the same transformers model under ``torch.autocast`` (for ``bf16-mixed``): backbone, head on the response
  positions only, fp32 log-softmax, the GMC loss written out (eq. 9, 12; ``seq_sum_over_T``), backward,
  ``clip_grad_norm_``, ``AdamW.step``, the LR scheduler, ``zero_grad``.

Each side runs in its own process (a Qwen3-0.6B-shaped learner holds ~10 GB: parameters, gradients and AdamW's
moments in fp32), one after the other, never together; a pair is one run of each, and pairs alternate which side
goes first. Each run leaves out its first update (AdamW allocates its state there; on the lit side no interval ends
it) and then ``--warmup`` more, and gives the median of the rest, by wall and by CPU time; the script prints each
pair's ratio lit_gmc / bare and the median ratio over pairs with its spread (min-max).

Shapes:
- ``qwen3-0.6b``: a random Qwen3 with Qwen3-0.6B's sizes (hidden 1024, 28 layers, 16 heads, 8 KV heads, head_dim
  128, intermediate 3072, vocab 151,936, tied embeddings), built in code (no hub), 2 groups x 2 rows, prompt 64 +
  response 192 tokens, ``bf16-mixed``, every core.
- ``tiny``: the embedded default's warm-started tiny actor, 8 groups x 8 rows, prompt 4 + response 6 tokens, fp32,
  one thread (as ``configs/tiny.yaml``).

    python scripts/bench/bench_step.py --shape qwen3-0.6b [--pairs 3] [--updates 2] [--warmup 0] [--layers 28]
    python scripts/bench/bench_step.py --shape tiny [--pairs 3] [--updates 60] [--warmup 10]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
import torch

from lit_gmc.batch import RolloutBatch, RolloutGroup, collate_groups


@dataclass(frozen=True)
class Shape:
    """One benchmark shape: batch sizes, precision and threads."""

    groups: int
    rows: int  # G
    prompt: int
    response: int  # also the loss normaliser T
    precision: str
    threads: int  # 0: every core


SHAPES = {
    "qwen3-0.6b": Shape(groups=2, rows=2, prompt=64, response=192, precision="bf16-mixed", threads=0),
    "tiny": Shape(groups=8, rows=8, prompt=4, response=6, precision="32-true", threads=1),
}
EPS, MAX_NORM, LR = 0.28, 1.0, 2e-4  # the defaults: GMC (cap 0.28), grad-norm clip 1, AdamW lr 2e-4, cosine


def build_qwen3_0p6b(path: Path, layers: int = 28) -> None:
    """Save a random Qwen3-0.6B-shaped actor (bf16 weights) with the tiny character tokenizer at ``path``."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from lit_gmc.actor import build_char_tokenizer

    config = Qwen3Config(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=layers, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, max_position_embeddings=40960,
        rope_theta=1_000_000.0, rms_norm_eps=1e-6,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    build_char_tokenizer().save_pretrained(path)


def fixed_batches(shape: Shape, vocab: int, count: int, seed: int = 0) -> list[RolloutBatch]:
    """``count`` seeded random batches of the shape's sizes (full-length responses, one version each: delay 0)."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for step in range(count):
        groups = []
        for b in range(shape.groups):
            size = (shape.rows, shape.response)
            groups.append(RolloutGroup(
                prompt_id=b, prompt="", answer="",
                prompt_ids=torch.randint(3, vocab, (shape.prompt,), generator=generator),
                response_ids=torch.randint(3, vocab, size, generator=generator),
                response_mask=torch.ones(size, dtype=torch.bool),
                behavior_logprobs=torch.randn(size, generator=generator) - math.log(vocab),  # a random policy's
                finish_reasons=["length"] * shape.rows,
                rewards=torch.randint(0, 2, (shape.rows,), generator=generator).float(),
                version=step, batch_id=step,
            ))  # fmt: skip
        batches.append(collate_groups(groups, pad_id=0, info={"draining": 0.0, "queue_depth": 0.0}))
    return batches


def now() -> tuple[float, float]:
    """Wall time and this process's CPU time (every thread), in seconds."""
    return time.perf_counter(), time.process_time()


def intervals(marks: list[tuple[float, float]]) -> dict[str, list[float]]:
    """Seconds between consecutive marks, by each clock."""
    pairs = list(zip(marks, marks[1:], strict=False))
    return {"wall": [b[0] - a[0] for a, b in pairs], "cpu": [b[1] - a[1] for a, b in pairs]}


class Stream:
    """The batches as one sized iterable, as the DataModule's ``RolloutStream`` gives them (a list would be read as
    a list of loaders)."""

    def __init__(self, batches: list[RolloutBatch]) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        return iter(self.batches)


class UpdateClock(pl.Callback):
    """The clocks at every ``on_train_batch_end``: consecutive differences are whole update cycles."""

    def __init__(self) -> None:
        self.marks: list[tuple[float, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.marks.append(now())


def lit_side(actor: str, shape: Shape, updates: int, workdir: Path) -> dict[str, list[float]]:
    """Seconds of each update of ``GMCModule`` trained by Lightning (the first one left out: no interval ends it)
    and the losses it logged."""
    from lightning.pytorch.loggers import TensorBoardLogger

    from lit_gmc.callbacks.delays import DelayAccounting
    from lit_gmc.callbacks.diagnostics import Diagnostics
    from lit_gmc.cli import GMCCLI, embedded_default
    from lit_gmc.tblog import read_scalars

    args = ["--config", embedded_default(), "--model.actor", actor, "--data.group_size", str(shape.rows),
            "--data.batch_prompts", str(shape.groups), "--data.max_new_tokens", str(shape.response),
            "--trainer.max_steps", str(updates), "--trainer.logger=false", "--torch_num_threads",
            str(torch.get_num_threads())]  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        model = GMCCLI(args=args, run=False).model
    vocab = model.actor.get_input_embeddings().num_embeddings
    timer = UpdateClock()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, precision=shape.precision, max_steps=updates, log_every_n_steps=1,
        num_sanity_val_steps=0, enable_model_summary=False, enable_checkpointing=False,
        logger=TensorBoardLogger(workdir, name="bench"),
        callbacks=[DelayAccounting(histogram_every_n_steps=10), Diagnostics(), timer],
    )  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        trainer.fit(model, train_dataloaders=Stream(fixed_batches(shape, vocab, updates)))
    losses = [value for _, value in read_scalars(workdir).get("train/loss", [])]
    return {**intervals(timer.marks), "losses": losses}


def gmc_loss(logprobs, behavior, mask, rewards, group_size: int, max_length: int):
    """GMC's surrogate (eq. 9, 12) with ``seq_sum_over_T``, written out: scalar."""
    log_ratio = ((logprobs.detach() - behavior) * mask).sum(-1).view(-1, group_size)  # (B, G)
    log_mean = torch.logsumexp(log_ratio, -1, keepdim=True) - math.log(group_size)  # (B, 1)
    coef = torch.exp(log_ratio - (log_mean - math.log1p(EPS)).clamp(min=0))  # (B, G)
    r = rewards.view(-1, group_size)  # (B, G)
    advantage = r - (r.sum(-1, keepdim=True) - r) / (group_size - 1)  # (B, G) leave-one-out
    sequence = (logprobs * mask).sum(-1)  # (N,)
    return -(coef * advantage).flatten().mul(sequence).sum() / (max_length * rewards.numel())


def bare_side(actor: str, shape: Shape, updates: int) -> dict[str, list[float]]:
    """Seconds of each update of the bare loop (the first one left out, as on the lit side), and its losses."""
    from lit_gmc.actor import load_actor

    model, _ = load_actor(actor)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.999), weight_decay=0.0)
    cosine = lambda s: 0.5 * (1.0 + math.cos(math.pi * min(1.0, s / updates)))  # noqa: E731
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=shape.precision == "bf16-mixed")
    batches = iter(fixed_batches(shape, model.get_input_embeddings().num_embeddings, updates))
    marks, losses = [now()], []
    for _ in range(updates):
        batch = next(batches)
        width, length = batch.prompt_width, batch.response_mask.shape[1]
        with autocast:
            hidden = model.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                 position_ids=batch.position_ids).last_hidden_state  # fmt: skip
            logits = model.lm_head(hidden[:, width - 1 : width - 1 + length])  # (N, L, V)
        logprobs = logits.float().log_softmax(-1).gather(-1, batch.input_ids[:, width:, None])[..., 0]  # (N, L)
        loss = gmc_loss(logprobs, batch.behavior_logprobs, batch.response_mask, batch.rewards, batch.group_size,
                        shape.response)  # fmt: skip
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        del hidden, logits, logprobs, loss
        marks.append(now())
    return {**intervals(marks[1:]), "losses": losses}


def run_side(side: str, actor: str, shape_name: str, updates: int) -> dict[str, list[float]]:
    """One side in a fresh process (its memory is released when it exits): seconds of its updates, its losses."""
    command = [sys.executable, __file__, "--side", side, "--actor", actor, "--shape", shape_name,
               "--updates", str(updates)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{side} side failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    """Alternate the two sides in pairs and print each pair's ratio and the median with its spread."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    parser.add_argument("--pairs", type=int, default=3, help="runs of each side, alternated")
    parser.add_argument("--updates", type=int, help="timed updates per run (default: 2 for qwen3-0.6b, 60 for tiny)")
    parser.add_argument("--warmup", type=int, help="updates left out after the first (default: 0, tiny 10)")
    parser.add_argument(
        "--clock",
        choices=["cpu", "wall"],
        default="wall",
        help="the headline's clock: wall time, or process CPU time (steadier when other processes share the cores); "
        "both are printed",
    )
    parser.add_argument(
        "--layers", type=int, default=28, help="qwen3-0.6b's layers (fewer: a quick check of the script)"
    )
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--side", choices=["lit", "bare"], help=argparse.SUPPRESS)  # one side, in a child process
    parser.add_argument("--actor", help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    torch.set_num_threads(shape.threads or os.cpu_count() or 1)
    if args.side:  # child: run `--updates` updates (warm-up included) and print their seconds as JSON
        with tempfile.TemporaryDirectory() as tmp:
            if args.side == "lit":
                figures = lit_side(args.actor, shape, args.updates, Path(tmp))
            else:
                figures = bare_side(args.actor, shape, args.updates)
        print(json.dumps(figures))
        return
    timed = args.updates or (2 if args.shape == "qwen3-0.6b" else 60)
    warmup = args.warmup if args.warmup is not None else (0 if args.shape == "qwen3-0.6b" else 10)
    total = timed + warmup + 1  # the first update ends no interval on the lit side: left out on both sides
    with tempfile.TemporaryDirectory() as tmp:
        actor = "tiny"
        if args.shape == "qwen3-0.6b":
            actor = str(Path(tmp) / "qwen3-0.6b-random")
            build_qwen3_0p6b(Path(actor), args.layers)
            gc.collect()
        pairs = []
        for pair in range(args.pairs):
            order = ("lit", "bare") if pair % 2 == 0 else ("bare", "lit")
            out = {side: run_side(side, actor, args.shape, total) for side in order}
            if pair == 0 and out["lit"]["losses"]:  # same math on both sides: the losses of the same updates
                gap = max(abs(a - b) for a, b in zip(out["lit"]["losses"], out["bare"]["losses"], strict=True))
                print(f"same loss on both sides: max |lit_gmc - bare| over {total} updates = {gap:.3g}")
            figures = {}
            for clock in ("wall", "cpu"):
                lit, bare = (statistics.median(out[side][clock][warmup:]) for side in ("lit", "bare"))
                figures[clock] = {"lit_s": lit, "bare_s": bare, "ratio": lit / bare}
            pairs.append({"order": order, **figures, "runs": out})
            print(f"pair {pair} ({' then '.join(order)}): " + "; ".join(
                f"{clock} lit_gmc {f['lit_s']:.4g} s, bare {f['bare_s']:.4g} s, ratio {f['ratio']:.3f}"
                for clock, f in figures.items()) + f"  (load {os.getloadavg()[0]:.2f})", flush=True)  # fmt: skip
    print(
        f"{args.shape}, {timed} timed updates a run after {warmup + 1} warm-up, median ratio over {len(pairs)} pairs:"
    )
    for clock in (args.clock, "cpu" if args.clock == "wall" else "wall"):
        ratios = [p[clock]["ratio"] for p in pairs]
        print(f"  {clock:>4} clock: {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})")
    if args.json:
        args.json.write_text(
            json.dumps({"shape": args.shape, "args": vars(args), "pairs": pairs}, indent=1, default=str)
        )


if __name__ == "__main__":
    main()
