"""``lit-gmc export``: a training checkpoint becomes a transformers ``save_pretrained`` folder.

The folder holds the policy after the checkpoint's last update, its config and tokenizer, for
``AutoModelForCausalLM.from_pretrained`` and ``vllm.LLM``. The checkpoint is a file or a folder of FSDP2 shards
(read on one process, without optimizer states); the folder is written aside and moved into place.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lit_gmc.errors import UserError, first_line

if TYPE_CHECKING:
    import torch

DTYPES = ("bfloat16", "float16", "float32")  # torch's names; torch itself is imported when a checkpoint is read
PREFIX = "actor."
SHARD_PREFIX = "state_dict."  # Lightning saves {"state_dict": ..., "optimizer_0": ...}; DCP flattens the keys


class OutExistsError(UserError, FileExistsError):
    """``--out`` exists: exports never overwrite."""


def actor_state(checkpoint: dict, ckpt_path: str | Path = "the checkpoint") -> dict[str, torch.Tensor]:
    """The actor's tensors of a lit_gmc checkpoint, under the model's own parameter names."""
    state = checkpoint.get("state_dict")
    if not isinstance(state, dict) or not any(key.startswith(PREFIX) for key in state):
        raise UserError(
            f"--ckpt_path {ckpt_path}: not a lit_gmc training checkpoint: it has no 'actor.*' tensors in its state_dict"
        )
    return {key.removeprefix(PREFIX): value for key, value in state.items() if key.startswith(PREFIX)}


def check_fit(shapes: dict[str, tuple[int, ...]], model: torch.nn.Module, ckpt_path: Path, actor: str) -> None:
    """Raise a :class:`UserError` unless ``shapes`` (the checkpoint's actor tensors) are exactly ``model``'s.

    What ``load_state_dict(strict=True)`` checks, in one line: an actor other than the one trained.
    """
    wanted = {name: tuple(value.shape) for name, value in model.state_dict().items()}
    problems = [f"{name} is {list(shapes[name])}, the actor's {list(shape)}" for name, shape in wanted.items()
                if name in shapes and shapes[name] != shape]  # fmt: skip
    problems += [f"missing {name}" for name in wanted if name not in shapes]
    problems += [f"unexpected {name}" for name in shapes if name not in wanted]
    if problems:
        more = f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
        raise UserError(
            f"--ckpt_path {ckpt_path}: its weights do not fit the actor {actor} ({'; '.join(problems[:3])}{more})"
        )


def load_sharded_actor(folder: Path, model: torch.nn.Module, actor: str) -> None:
    """Read the ``state_dict.actor.*`` tensors of a sharded checkpoint into ``model``, in place, on this process.

    They are resharded from however many ranks wrote them, once :func:`check_fit` has checked names and shapes.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    try:
        stored = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    except Exception as err:  # a missing or unreadable .metadata: an interrupted save, or not DCP at all
        raise UserError(f"--ckpt_path {folder}: its shards cannot be read ({first_line(err)})") from err
    prefix = SHARD_PREFIX + PREFIX
    check_fit({key.removeprefix(prefix): tuple(getattr(meta, "size", ())) for key, meta in stored.items()
               if key.startswith(prefix)}, model, folder, actor)  # fmt: skip
    try:
        with warnings.catch_warnings():  # that it reads on one process, which is what we ask for
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({SHARD_PREFIX.rstrip("."): {PREFIX + name: value for name, value in model.state_dict().items()}},
                     checkpoint_id=str(folder), no_dist=True)  # fmt: skip
    except (Exception, CheckpointException) as err:  # a missing or truncated shard file
        failures = [exc for exc, _ in getattr(err, "failures", {}).values()] or [err]  # DCP wraps each rank's
        raise UserError(f"--ckpt_path {folder}: its shards cannot be read ({first_line(failures[0])})") from err


def load_checkpoint_actor(
    ckpt_path: str | Path, actor: str | None = None, option: str = "--actor"
) -> tuple[torch.nn.Module, Any, str]:
    """``(model, tokenizer, actor)``: the actor of a lit_gmc checkpoint (a file or a sharded folder), its weights set.

    ``actor`` (set by the flag ``option``, named in messages; ``None``: the checkpoint's own) is loaded with the
    weights. A :class:`UserError` for a path that is no lit_gmc checkpoint, or an actor that fails or does not fit.
    """
    from lit_gmc.actor import load_actor
    from lit_gmc.resume import SHARDED_METADATA, read_checkpoint

    path = Path(ckpt_path)
    if path.name == SHARDED_METADATA and (path.parent / ".metadata").is_file():
        raise UserError(f"--ckpt_path {path} is the metadata of a sharded checkpoint: pass its folder, {path.parent}")
    checkpoint = read_checkpoint(path)  # a UserError naming --ckpt_path for anything but a lit_gmc checkpoint
    state = None if path.is_dir() else actor_state(checkpoint, path)
    named = checkpoint.get("hyper_parameters", {}).get("actor")
    if actor is None and not isinstance(named, str):
        raise UserError(f"--ckpt_path {path}: no 'actor' in the checkpoint's hyper_parameters; name it with {option}")
    label = option if actor is not None else f"{option} (from --ckpt_path {path})"
    actor = actor if actor is not None else named
    model, tokenizer = load_actor(actor, option=label)
    if state is None:
        load_sharded_actor(path, model, actor)
    else:
        check_fit({name: tuple(value.shape) for name, value in state.items()}, model, path, actor)
        model.load_state_dict(state, strict=True)
    return model, tokenizer, actor


def export_checkpoint(
    ckpt_path: str | Path, out_dir: str | Path, dtype: str = "float32", actor: str | None = None
) -> Path:
    """Write the actor of ``ckpt_path`` to ``out_dir`` (which must not exist) in ``save_pretrained`` layout."""
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise OutExistsError(f"--out {out_dir} exists; choose a new folder (exports never overwrite)")
    import torch

    model, tokenizer, _ = load_checkpoint_actor(ckpt_path, actor)
    model.to(getattr(torch, dtype))
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    except OSError as err:  # a read-only or full disk, a file in the way
        raise UserError(f"--out {out_dir}: cannot write there ({err})") from err
    # Batched generation appends after each prompt, so pad before it. save_pretrained writes the init kwargs, not
    # the attribute, so both are set (the tokenizer's own padding_side="left" at load time ends the same way).
    tokenizer.padding_side = tokenizer.init_kwargs["padding_side"] = "left"
    try:
        os.chmod(staging, 0o777 & ~current_umask())  # as mkdir would make it (mkdtemp's is private: 0o700)
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        for written in staging.iterdir():  # safetensors writes its file private (0o600): readable as any other file
            os.chmod(written, 0o666 & ~current_umask())
        os.replace(staging, out_dir)
    except OSError as err:
        raise UserError(f"--out {out_dir}: cannot write there ({err})") from err
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def current_umask() -> int:
    """The process's umask (read by setting it, so it is set back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def resolved_checkpoint(ckpt_path: str, fit_args: list[str]) -> str:
    """``--ckpt_path`` as given, or for ``last`` the newest ``last*.ckpt`` where ``lit-gmc fit FIT_ARGS`` writes.

    ``fit_args`` (the run's ``--config`` files and options) are read by :class:`~lit_gmc.cli.FitConfig`.
    """
    if ckpt_path != "last":
        return ckpt_path
    from lit_gmc.cli import FitConfig
    from lit_gmc.resume import checkpoint_file

    folder = FitConfig(fit_args).config.checkpoint.dirpath
    found = checkpoint_file("last", folder)
    if found is None:
        raise UserError(
            f"--ckpt_path last: no last*.ckpt in {folder}, the checkpoint folder of the run's config; pass the run's "
            "--config files and options as given to fit, or the checkpoint's path"
        )
    return str(found)


def main(argv: list[str] | None = None) -> None:
    """Command line of ``lit-gmc export``; options it does not know are the run's, as given to ``fit``."""
    parser = argparse.ArgumentParser(prog="lit_gmc export", description=__doc__.splitlines()[0], allow_abbrev=False,
                                     epilog="Other options are the run's, as given to fit (--config FILE ...), to find "
                                     "its checkpoint folder for --ckpt_path last (default: runs/addition_tiny/"
                                     "checkpoints, the embedded default's).")  # fmt: skip
    parser.add_argument("--ckpt_path", required=True,
                        help="a checkpoint of lit_gmc fit (e.g. last.ckpt), a file or a sharded folder; 'last': the "
                        "newest last*.ckpt of the run's checkpoint folder, as in fit")  # fmt: skip
    parser.add_argument("--out", required=True, help="new folder for the transformers model and tokenizer")
    parser.add_argument("--dtype", choices=DTYPES, default="float32",
                        help="dtype of the saved weights (training keeps fp32 master weights)")  # fmt: skip
    parser.add_argument("--actor", default=None,
                        help="the model to load the weights into (default: the checkpoint's actor); a local copy "
                        "of it where that is out of reach, e.g. a hub name on an offline machine")  # fmt: skip
    args, fit_args = parser.parse_known_args(argv)
    ckpt_path = resolved_checkpoint(args.ckpt_path, fit_args)
    out = export_checkpoint(ckpt_path, args.out, args.dtype, args.actor)
    print(f"exported {ckpt_path} -> {out}")
