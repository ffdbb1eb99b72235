"""``lit_gmc.callbacks`` stays importable into other projects: it adds no transformers, vLLM or learner code.

Lightning itself imports torchmetrics, which imports transformers when it is installed, so the check is
against what ``import lightning.pytorch`` already brought in: our callbacks must add none of it.
"""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import lit_gmc.callbacks

FORBIDDEN = ("transformers", "vllm", "lit_gmc.module", "lit_gmc.actor", "lit_gmc.data.datamodule")


def test_importing_every_callback_module_adds_nothing_heavy():
    modules = [f"lit_gmc.callbacks.{m.name}" for m in pkgutil.iter_modules(lit_gmc.callbacks.__path__)]
    assert "lit_gmc.callbacks.weight_sync" in modules
    code = (
        "import importlib, sys\n"
        "import lightning.pytorch\n"
        "before = set(sys.modules)\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "added = set(sys.modules) - before\n"
        f"print(sorted(n for n in added if n.split('.')[0] in ('transformers', 'vllm') or n in {FORBIDDEN!r}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", f"callbacks imported {out.stdout.strip()}"
