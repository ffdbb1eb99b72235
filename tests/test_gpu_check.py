"""scripts/gpu_check.sh: `prepare` gathers pure-Python wheels under 64 MiB, and with only those (on top of what the
lent GPU machine has) every lit_gmc module imports.

The GPU machine has torch, Lightning, transformers, tensorboard and torchmetrics, and lacks vLLM, bitsandbytes,
jsonargparse, datasets and math-verify. The closest check that fits CI: download the wheels with `prepare` (it
needs the package index, which CI has), unpack them, and import every module in a fresh interpreter where vLLM,
bitsandbytes and datasets cannot be imported at all and every package the wheels provide can be imported only from
them (not from this environment's site-packages). It runs on this environment's torch, not 2.11.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.sh"
VLLM_PLUGINS = {"lit_gmc.data.engines.weight_transfer"}
"""Modules that vLLM itself loads (its plugin entry point) and that import vLLM at the top, by design."""

IMPORT_EVERYTHING = r"""
import importlib, importlib.abc, importlib.machinery, pkgutil, sys
site, provided, vllm_plugins = sys.argv[1], set(sys.argv[2].split(",")), set(sys.argv[3].split(","))
ABSENT = {"vllm", "bitsandbytes", "datasets"}

class GpuMachine(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        top = name.partition(".")[0]
        if top in ABSENT:
            raise ModuleNotFoundError(f"No module named {name!r} (absent on the GPU machine)", name=name)
        if top in provided and "." not in name:  # only from the wheels
            spec = importlib.machinery.PathFinder.find_spec(name, [site])
            if spec is None:
                raise ModuleNotFoundError(f"No module named {name!r} in the wheels", name=name)
            return spec
        return None

sys.meta_path.insert(0, GpuMachine())
import lit_gmc
failed = []
names = ["lit_gmc"] + [m.name for m in pkgutil.walk_packages(lit_gmc.__path__, "lit_gmc.")]
for name in names:
    if name in vllm_plugins:
        continue
    try:
        importlib.import_module(name)
    except Exception as err:
        failed.append(f"{name}: {type(err).__name__}: {err}")
import jsonargparse, math_verify, rich, pytest
wrong = [m.__name__ for m in (jsonargparse, math_verify, rich, pytest) if not m.__file__.startswith(site)]
print(len(names), "modules;", "failed:", failed, "not from the wheels:", wrong)
sys.exit(1 if failed or wrong else 0)
"""


def test_the_script_parses_and_names_its_steps():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    usage = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True)
    assert usage.returncode == 2 and "prepare | run" in usage.stderr
    ignored = subprocess.run(["git", "check-ignore", "-q", ".whl/x.whl"], cwd=REPO)
    assert ignored.returncode == 0, "the wheel folder must be ignored by git (it travels as a carried path)"


@pytest.mark.slow
def test_prepare_gathers_pure_python_wheels_under_64_mib_and_every_module_imports_with_them(tmp_path):
    wheels = tmp_path / "whl"
    env = {**os.environ, "WHEELS_DIR": str(wheels)}
    done = subprocess.run(["bash", str(SCRIPT), "prepare"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    if done.returncode and any(s in done.stderr for s in ("NewConnectionError", "Temporary failure", "unreachable")):
        pytest.skip(f"no package index: {done.stderr[-300:]}")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    files = sorted(wheels.glob("*.whl"))
    assert sum(p.stat().st_size for p in files) < 64 << 20
    assert all(p.name.endswith("-none-any.whl") for p in files)
    site = tmp_path / "site"
    provided = set()
    for wheel in files:
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(site)
            provided |= {n.split("/")[0].removesuffix(".py") for n in archive.namelist()
                         if not n.split("/")[0].endswith((".dist-info", ".data"))}  # fmt: skip
    assert {"jsonargparse", "math_verify", "latex2sympy2_extended", "rich", "pytest", "setuptools"} <= provided
    provided.discard("setuptools")  # a build dependency of the install; this interpreter's own may stay
    provided = {p for p in provided if p.isidentifier()}
    imported = subprocess.run([sys.executable, "-c", IMPORT_EVERYTHING, str(site), ",".join(sorted(provided)),
                               ",".join(VLLM_PLUGINS)], cwd=tmp_path, capture_output=True, text=True,
                              timeout=300)  # fmt: skip
    assert imported.returncode == 0, imported.stdout[-3000:] + imported.stderr[-3000:]
