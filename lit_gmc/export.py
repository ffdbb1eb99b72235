"""``python -m lit_gmc export``: a training checkpoint becomes a transformers ``save_pretrained`` folder.

The folder holds the actor's weights (the learner's ``actor.*`` tensors, i.e. the policy after the checkpoint's
last update), its config and its tokenizer, so ``AutoModelForCausalLM.from_pretrained`` and ``vllm.LLM`` load
it directly. The actor named in the checkpoint's hyper-parameters supplies the architecture and tokenizer; the
folder is written to a temporary sibling and moved into place, so an interrupted export leaves nothing half-done.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PREFIX = "actor."


def actor_state(checkpoint: dict) -> dict[str, torch.Tensor]:
    """The actor's tensors of a lit_gmc checkpoint, under the model's own parameter names."""
    state = checkpoint.get("state_dict")
    if not isinstance(state, dict) or not any(key.startswith(PREFIX) for key in state):
        raise ValueError("not a lit_gmc training checkpoint: it has no 'actor.*' tensors in its state_dict")
    return {key.removeprefix(PREFIX): value for key, value in state.items() if key.startswith(PREFIX)}


def export_checkpoint(ckpt_path: str | Path, out_dir: str | Path, dtype: str = "float32") -> Path:
    """Write the actor of ``ckpt_path`` to ``out_dir`` (which must not exist) in ``save_pretrained`` layout."""
    from lit_gmc.actor import load_actor

    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} exists; choose a new folder (exports never overwrite)")
    checkpoint = torch.load(ckpt_path, map_location="cpu", weights_only=True)
    state = actor_state(checkpoint)
    actor = checkpoint.get("hyper_parameters", {}).get("actor")
    if not isinstance(actor, str):
        raise ValueError(f"{ckpt_path}: no 'actor' in the checkpoint's hyper_parameters")
    model, tokenizer = load_actor(actor)
    model.load_state_dict(state, strict=True)
    model.to(DTYPES[dtype])
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        os.replace(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    """Command line of ``python -m lit_gmc export``."""
    parser = argparse.ArgumentParser(prog="python -m lit_gmc export", description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt_path", required=True, help="a checkpoint written by lit_gmc fit (e.g. last.ckpt)")
    parser.add_argument("--out", required=True, help="new folder for the transformers model and tokenizer")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                        help="dtype of the saved weights (training keeps fp32 master weights)")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        out = export_checkpoint(args.ckpt_path, args.out, args.dtype)
    except (OSError, ValueError) as err:
        parser.exit(2, f"export: {err}\n")
    print(f"exported {args.ckpt_path} -> {out}")
