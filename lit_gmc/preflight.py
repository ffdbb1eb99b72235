"""One check of what a run needs from this machine, before anything loads: every problem in one message.

Options are checked when they are parsed (``lit_gmc.cli``); this checks what they point at: the accelerator, the
rollout engine's package or its own ``preflight_problems``, the actor, the task's data sources and the run folder.
A hub name is fine when it is cached or the hub answers one quick connection; otherwise the message names the
option to point at a local copy and ``HF_HUB_OFFLINE``.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import socket
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch

HUB_TIMEOUT_S = 3.0
VLLM_INSTALL = "pip install -e '.[vllm]' on a GPU machine, '.[cpu-vllm]' on a CPU one"


def offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` asks transformers and datasets never to reach the hub."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


@functools.cache
def hub_reachable() -> bool:
    """Whether one TCP connection to the hub's endpoint opens within :data:`HUB_TIMEOUT_S` (asked once a run)."""
    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    try:
        with socket.create_connection((url.hostname, url.port or 443), timeout=HUB_TIMEOUT_S):
            return True
    except OSError:
        return False


def hub_cached(repo_id: str, kind: str) -> bool:
    """Whether the hub cache holds a snapshot of ``repo_id`` (``kind``: ``"model"`` or ``"dataset"``)."""
    from huggingface_hub import constants

    cache = Path(os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE)
    return (cache / f"{kind}s--{repo_id.replace('/', '--')}" / "snapshots").is_dir()


def hub_problem(repo_id: str, kind: str, option: str) -> str | None:
    """Why the hub ``repo_id`` named by ``option`` cannot be read here, or None."""
    if hub_cached(repo_id, kind):
        if offline() or hub_reachable():
            return None
        return f"{option} {repo_id}: the hub is unreachable; set HF_HUB_OFFLINE=1 to use the cached copy"
    if offline():
        return (f"{option} {repo_id}: HF_HUB_OFFLINE is set and the {kind} is not in the hub cache; point {option} "
                f"at a local copy, or unset HF_HUB_OFFLINE where the hub can be reached")  # fmt: skip
    if not hub_reachable():
        return (f"{option} {repo_id}: the hub cannot be reached from here (no connection within {HUB_TIMEOUT_S:g} s); "
                f"point {option} at a local copy (and set HF_HUB_OFFLINE=1)")  # fmt: skip
    return None


def source_problem(path: str, kind: str, option: str, is_local: bool) -> str | None:
    """Why the data or model source ``path`` (a local path when ``is_local``, else a hub name) cannot be read."""
    if is_local or path.startswith(("/", ".", "~")):
        found = Path(path).expanduser()
        what = "model folder" if kind == "model" else "file or folder"
        return None if found.exists() else f"{option} {path}: no such {what} (resolved to {found.resolve()})"
    return hub_problem(path, kind, option)


def accelerator_problems(accelerator: Any, devices: Any) -> list[str]:
    """An accelerator this machine lacks, or more CUDA devices than it has."""
    name = str(getattr(accelerator, "class_path", accelerator) or "auto").lower()
    if name not in ("gpu", "cuda") and "cuda" not in name:
        return []
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        return [f"--trainer.accelerator={name}: no CUDA GPU is usable here (torch {torch.__version__}, {build}); "
                "use --trainer.accelerator cpu"]  # fmt: skip
    wanted = devices if isinstance(devices, int) else len(devices) if isinstance(devices, (list, tuple)) else None
    if isinstance(devices, str) and devices.isdigit():
        wanted = int(devices)
    if wanted is not None and wanted > torch.cuda.device_count():
        return [f"--trainer.devices={devices}: this machine has {torch.cuda.device_count()} CUDA device(s)"]
    return []


def engine_problems(engine: type, init_args: dict[str, Any], actor: str) -> list[str]:
    """The engine's own ``preflight_problems(actor)`` when it has one (servers, devices), else vLLM's package.

    One without its own check is taken to need vLLM here when its module is named after it.
    """
    name = engine.__name__
    if getattr(engine, "preflight_problems", None) is not None:
        return [f"--data.engine {name}: {problem}" for problem in engine(**init_args).preflight_problems(actor)]
    if "vllm" in engine.__module__.lower() and importlib.util.find_spec("vllm") is None:
        return [f"--data.engine {name} needs vLLM, which is not installed here: {VLLM_INSTALL}"]
    return []


def actor_problem(actor: str) -> str | None:
    """A local actor folder that is missing, or a hub actor out of reach (``tiny`` is built here)."""
    if actor == "tiny":
        return None
    return source_problem(actor, "model", "--model.actor", Path(actor).expanduser().exists())


def writable_problem(folder: str | None, option: str) -> str | None:
    """Why the run folder ``folder`` (made if missing) could not be written, or None."""
    if folder is None:
        return None
    path = Path(folder).expanduser().absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        return f"{option} {folder}: cannot be written here ({existing} is a file)"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{option} {folder}: cannot be written here ({existing} is not writable by this user)"
    return None
