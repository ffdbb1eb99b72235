"""One learner update of random Qwen3-1.7B/4B-shaped models on one GPU, and HFEngine generation at that shape.

Needs neither vLLM nor bitsandbytes (the lent GPU machine has neither): the optimizer is torch's fused AdamW, so
the memory it is compared with is :mod:`memory_estimate`'s "fp32 master + bf16-mixed + fp32 AdamW" setting.
For each model (a transformers ``Qwen3Config`` with the released model's sizes, random weights, the character
tokenizer; built on the GPU, saved in bf16, loaded by the learner in fp32):

- Learner: ``GMCModule`` with the Qwen3 configs' precision (fp32 master weights under Lightning's ``bf16-mixed``),
  gradient checkpointing, ``micro_batch_groups: 1`` and ``logit_chunk_tokens: 512``, trained by a Lightning
  ``Trainer`` on one group of ``--sequences`` rows of ``--prompt-tokens + --completion-tokens`` (the paper's
  8 x 5,120: the micro-batch :mod:`memory_estimate` sizes), ``--updates`` times. Reported: each update's seconds
  (the first allocates AdamW's state), the peak allocated and reserved memory over all updates against the
  estimate's peak, and tokens/s and MFU of the last update. MFU counts the model's FLOPs, 3 x the forward's
  matmuls (decoder linears and causal attention on every token, the LM head on the response tokens, where the
  learner runs it), not the recomputation of gradient checkpointing, against ``--peak-tflops`` (989: H100/H200
  dense bf16).
- Rollouts: ``HFEngine`` (transformers ``generate``) on the bf16 weights, ``--sequences`` samples of one prompt
  of ``--prompt-tokens``, ``--generate-tokens`` new tokens each (random weights rarely sample EOS): tokens/s.

    python scripts/gpu_learner_check.py --out "$OUT/gpu_check.md"                 # 1.7B and 4B
    python scripts/gpu_learner_check.py --models 1.7B --accelerator cpu --layers 2 --prompt-tokens 16 \\
        --completion-tokens 16 --sequences 2 --generate-tokens 4 --out /tmp/learner.md   # CPU smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

if str(Path(__file__).resolve().parent) not in sys.path:  # `python scripts/...` has it; an import by path not
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_scale_check import DTYPE, PRECISION, build_actor, make_prompts, sync  # noqa: E402
from memory_estimate import GIB, QWEN3, SETTINGS, Arch, Workload, single_gpu  # noqa: E402

from lit_gmc.actor import build_char_tokenizer  # noqa: E402
from lit_gmc.batch import RolloutGroup, collate_groups  # noqa: E402
from lit_gmc.data.engines.base import SamplingParams  # noqa: E402
from lit_gmc.data.engines.hf import HFEngine
from lit_gmc.module import GMCModule  # noqa: E402
from lit_gmc.rules import GMC  # noqa: E402

TORCH_ADAMW = next(s for s in SETTINGS if s.optimizer == "adamw" and s.autocast)
COLUMNS = ("model", "params", "tokens/update", "update s (each)", "learner tok/s", "MFU", "peak alloc GiB",
           "peak reserved GiB", "estimate GiB", "alloc / estimate", "HFEngine tok/s")  # fmt: skip


def model_flops_per_update(arch: Arch, sequences: int, prompt: int, completion: int) -> float:
    """3 x the forward's matmul FLOPs: decoder linears and causal attention on every token, the head on responses."""
    q, kv = arch.heads * arch.head_dim, arch.kv_heads * arch.head_dim
    linear = arch.hidden * (2 * q + 2 * kv) + 3 * arch.hidden * arch.intermediate  # q, o, k, v and the SwiGLU MLP
    length = prompt + completion
    tokens = sequences * length
    attention = 4 * q * length / 2  # QK^T and AV, 2 FLOPs a multiply-add, over half the context on average
    forward = tokens * arch.layers * (2 * linear + attention) + sequences * completion * 2 * arch.hidden * arch.vocab
    return 3.0 * forward


def scaled_arch(args: argparse.Namespace, key: str) -> Arch:
    """The released model's sizes, with ``--layers`` when given (a shorter model for a smoke run)."""
    arch = QWEN3[key]
    return dataclasses.replace(arch, layers=args.layers) if args.layers else arch


def shape_namespace(arch: Arch, args: argparse.Namespace) -> argparse.Namespace:
    """What :func:`gpu_scale_check.build_actor` reads."""
    return argparse.Namespace(vocab=arch.vocab, hidden=arch.hidden, intermediate=arch.intermediate,
                              layers=arch.layers, heads=arch.heads, kv_heads=arch.kv_heads, head_dim=arch.head_dim,
                              prompt_tokens=args.prompt_tokens, completion_tokens=args.completion_tokens,
                              untied=not arch.tied, seed=args.seed)  # fmt: skip


def fixed_batch(args: argparse.Namespace, vocab: int, pad_id: int):
    """One group of full-length random responses; behaviour log-probs ``-log V`` (a near-uniform random policy)."""
    gen = torch.Generator().manual_seed(args.seed)
    rows, length = args.sequences, args.completion_tokens
    group = RolloutGroup(
        prompt_id=0, prompt="", answer="", prompt_ids=torch.randint(3, vocab, (args.prompt_tokens,), generator=gen),
        response_ids=torch.randint(3, vocab, (rows, length), generator=gen),
        response_mask=torch.ones(rows, length, dtype=torch.bool),
        behavior_logprobs=torch.full((rows, length), -float(torch.tensor(vocab).log())),
        finish_reasons=["length"] * rows, rewards=torch.randint(0, 2, (rows,), generator=gen).float(), version=0,
    )  # fmt: skip
    return collate_groups([group], pad_id=pad_id)


class UpdateTimer(pl.Callback):
    """Seconds of each update and the memory peak over all of them."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.start = 0.0

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

    def on_train_batch_start(self, *args: Any) -> None:
        sync()
        self.start = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        sync()
        self.seconds.append(time.perf_counter() - self.start)


def learner_update(args: argparse.Namespace, arch: Arch, folder: Path) -> dict[str, Any]:
    """``--updates`` updates on the fixed batch; seconds, tokens/s, MFU and peak memory."""
    module = GMCModule(
        actor=str(folder), correction=GMC(cap=0.28), dtype=DTYPE, max_grad_norm=1.0, micro_batch_groups=1,
        optimizer={"class_path": "torch.optim.AdamW",
                   "init_args": {"lr": 1e-6, "betas": (0.9, 0.999), "weight_decay": 0.0, "fused": args.fused}},
        logit_chunk_tokens=512, gradient_checkpointing=True, max_response_length=args.completion_tokens,
    )  # fmt: skip
    params = sum(p.numel() for p in module.actor.parameters())
    batch = fixed_batch(args, arch.vocab, build_char_tokenizer().pad_token_id)
    timer = UpdateTimer()
    trainer = pl.Trainer(accelerator=args.accelerator, devices=1, precision=PRECISION, max_steps=args.updates,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, callbacks=[timer])  # fmt: skip
    trainer.fit(module, torch.utils.data.DataLoader([batch] * args.updates, batch_size=None, collate_fn=None))
    tokens = int(batch.attention_mask.sum())
    last = timer.seconds[-1]
    flops = model_flops_per_update(arch, args.sequences, args.prompt_tokens, args.completion_tokens)
    out = {"params": params, "tokens": tokens, "seconds": timer.seconds, "tok/s": tokens / last,
           "MFU": flops / last / (args.peak_tflops * 1e12)}  # fmt: skip
    if torch.cuda.is_available():
        out.update(alloc=torch.cuda.max_memory_allocated() / GIB, reserved=torch.cuda.max_memory_reserved() / GIB)
    del trainer, module
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def generation_rate(args: argparse.Namespace, folder: Path) -> float:
    """HFEngine tokens/s: ``--sequences`` samples of one prompt, ``--generate-tokens`` new tokens each."""
    from transformers import AutoModelForCausalLM

    device = "cuda" if args.accelerator == "gpu" else "cpu"
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(device)
    engine = HFEngine.from_model(model, build_char_tokenizer())
    del model
    prompts = make_prompts(1, args.prompt_tokens, args.seed)
    sync()
    start = time.perf_counter()
    groups = engine.generate(prompts, args.sequences, SamplingParams(max_new_tokens=args.generate_tokens, seed=0))
    sync()
    seconds = time.perf_counter() - start
    engine.close()
    return sum(int(g.response_mask.sum()) for g in groups) / seconds


def row(key: str, arch: Arch, args: argparse.Namespace, learner: dict[str, Any], rate: float | None) -> str:
    """One Markdown row of :data:`COLUMNS`."""
    estimate = single_gpu(arch, TORCH_ADAMW, Workload(args.prompt_tokens, args.completion_tokens, args.sequences))
    alloc = learner.get("alloc")
    cells = [arch.name if arch.layers == QWEN3[key].layers else f"{arch.name} ({arch.layers} layers)",
             f"{learner['params'] / 1e9:.3f}B", str(learner["tokens"]),
             ", ".join(f"{s:.2f}" for s in learner["seconds"]), f"{learner['tok/s']:.0f}", f"{learner['MFU']:.1%}",
             f"{alloc:.1f}" if alloc is not None else "n/a",
             f"{learner['reserved']:.1f}" if alloc is not None else "n/a", f"{estimate['peak']:.1f}",
             f"{alloc / estimate['peak']:.2f}" if alloc is not None else "n/a",
             f"{rate:.0f}" if rate is not None else "n/a"]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    report = Path(args.out)
    report.parent.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    with report.open("a") as f:
        f.write(f"\n## Learner update and HFEngine generation (scripts/gpu_learner_check.py)\n\n- Device: {device}; "
                f"torch {torch.__version__}; one group of {args.sequences} x ({args.prompt_tokens} + "
                f"{args.completion_tokens}) tokens an update, {PRECISION} over {DTYPE} masters, gradient "
                f"checkpointing, torch AdamW (fused={args.fused}); estimate: scripts/memory_estimate.py, "
                f"\"{TORCH_ADAMW.name}\"; MFU against {args.peak_tflops:g} TFLOP/s; HFEngine: {args.sequences} x "
                f"{args.generate_tokens} new tokens after {args.prompt_tokens}.\n\n"
                "| " + " | ".join(COLUMNS) + " |\n|" + "---|" * 2 + "---:|" * (len(COLUMNS) - 2) + "\n")  # fmt: skip
    pl.seed_everything(args.seed)
    for key in args.models:
        arch = scaled_arch(args, key)
        with tempfile.TemporaryDirectory(prefix="lit_gmc_learner_") as tmp:
            folder = build_actor(shape_namespace(arch, args), Path(tmp) / "actor")
            learner = learner_update(args, arch, folder)
            rate = generation_rate(args, folder) if args.generate_tokens else None
        with report.open("a") as f:  # one row per model, written as soon as it is measured
            f.write(row(key, arch, args, learner, rate) + "\n")
    print(report.read_text())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["1.7B", "4B"], choices=list(QWEN3))
    parser.add_argument("--layers", type=int, default=None, help="fewer decoder layers (smoke runs)")
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--completion-tokens", type=int, default=4096)
    parser.add_argument("--sequences", type=int, default=8, help="rows of the one group an update trains on")
    parser.add_argument("--updates", type=int, default=2, help="the first allocates AdamW's state")
    parser.add_argument("--generate-tokens", type=int, default=256, help="HFEngine new tokens (0: skip)")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="the device's dense bf16 peak")
    parser.add_argument("--fused", action=argparse.BooleanOptionalAction, default=True, help="torch's fused AdamW")
    parser.add_argument("--accelerator", default="gpu", choices=["gpu", "cpu"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="gpu_check.md", help="Markdown report (appended to)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    main()
