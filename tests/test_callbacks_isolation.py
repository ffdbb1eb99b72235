"""``lit_gmc.callbacks`` stays importable into other projects: it adds no transformers, vLLM or learner code.

Lightning itself imports torchmetrics, which imports transformers when it is installed, so the check is
against what ``import lightning.pytorch`` already brought in: our callbacks must add none of it, and of our own
code only the pure modules they are built on.
"""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys

import lit_gmc.callbacks

PURE = ("lit_gmc", "lit_gmc.delays", "lit_gmc.distributed", "lit_gmc.errors", "lit_gmc.objectives")
"""What a callback may bring of ours besides ``lit_gmc.callbacks``: torch-only helpers, no model, data or engine."""


def test_importing_every_callback_module_adds_nothing_heavy():
    modules = [f"lit_gmc.callbacks.{m.name}" for m in pkgutil.iter_modules(lit_gmc.callbacks.__path__)]
    some = {"lit_gmc.callbacks.weight_sync", "lit_gmc.callbacks.evaluation", "lit_gmc.callbacks.diagnostics"}
    assert some <= set(modules)
    code = (
        "import importlib, sys\n"
        "import lightning.pytorch\n"
        "before = set(sys.modules)\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "added = set(sys.modules) - before\n"
        "print(sorted(n for n in added if n.split('.')[0] in ('transformers', 'vllm', 'lit_gmc')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    added = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    heavy = [n for n in added if not n.startswith("lit_gmc.callbacks") and n not in PURE]
    assert heavy == [], f"callbacks imported {heavy}"
