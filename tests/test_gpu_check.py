"""scripts/gpu_check.sh: `prepare` gathers pure-Python wheels under 64 MiB, and with only those (on top of what the
lent GPU machine has) every lit_gmc module imports.

The GPU machine has torch, Lightning, transformers, tensorboard and torchmetrics, and lacks vLLM, bitsandbytes,
jsonargparse, datasets and math-verify. The closest check that fits CI: download the wheels with `prepare` (it
needs the package index, which CI has), unpack them, and import every module in a fresh interpreter where vLLM,
bitsandbytes and datasets cannot be imported at all and every package the wheels provide can be imported only from
them (not from this environment's site-packages). It runs on this environment's torch, not 2.11.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
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


LENT_MACHINE = ("torch", "lightning", "transformers", "tensorboard", "pip")
"""What the lent GPU machine's Python has (with their dependencies); pip installs the carried wheels."""
NOT_ON_IT = ("vllm", "bitsandbytes", "jsonargparse", "datasets", "math_verify", "matplotlib")


def closure(roots: tuple[str, ...]) -> list[importlib.metadata.Distribution]:
    """The installed distributions ``roots`` need, their dependencies' dependencies included (no extras)."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen: dict[str, importlib.metadata.Distribution] = {}
    todo = list(roots)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        try:
            seen[name] = dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(seen.values())


def lent_machine_venv(root: Path) -> Path:
    """A venv without system site-packages holding exactly :data:`LENT_MACHINE` and their dependencies, each linked
    from this environment's site-packages (top-level modules and dist-info), so nothing else can be imported."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=60)
    site = next((root / "lib").glob("python3*/site-packages"))
    for dist in closure(LENT_MACHINE):
        tops = {Path(f).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops - {"__pycache__"}:
            source = Path(dist.locate_file(top))
            if source.exists() and not (site / top).exists() and not top.endswith(".pth"):
                (site / top).symlink_to(source)
    return root


def carried_wheels(folder: Path) -> Path:
    """The wheels `prepare` would carry, rebuilt offline from this environment's copies of the same versions."""
    names = re.search(r'WHEELS="([^"]*)"', SCRIPT.read_text()).group(1).split()
    folder.mkdir()
    for name in names:
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:  # exceptiongroup, tomli: Python 3.10 only
            continue
        stem = f"{re.sub(r'[-.]+', '_', dist.metadata['Name'])}-{dist.version}"
        with zipfile.ZipFile(folder / f"{stem}-py3-none-any.whl", "w") as wheel:
            for file in dist.files or []:
                if not str(file).startswith("..") and "__pycache__" not in str(file):
                    wheel.write(dist.locate_file(file), str(file))
    return folder


@pytest.mark.slow
def test_run_in_cpu_mode_installs_and_imports_with_only_the_lent_machines_packages(tmp_path):
    venv = lent_machine_venv(tmp_path / "venv")
    probe = "import importlib.util as u, sys; sys.exit(any(u.find_spec(n) for n in sys.argv[1:]))"
    assert subprocess.run([str(venv / "bin" / "python"), "-c", probe, *NOT_ON_IT], timeout=60).returncode == 0
    out = tmp_path / "out"
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path), "VENV": str(venv), "CPU": "1",
           "OUT": str(out), "WHEELS_DIR": str(carried_wheels(tmp_path / "whl")), "TOTAL_S": "480"}  # fmt: skip
    done = subprocess.run(["bash", str(SCRIPT), "run"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=480)  # fmt: skip
    report = (out / "gpu_check.md").read_text() if (out / "gpu_check.md").exists() else ""
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "lit_gmc imports" in report and "matplotlib absent" in report and "vllm absent" in report, report
    tests = (out / "tests.txt").read_text()
    assert "error" not in tests.lower() and re.search(r"\d+ (skipped|deselected)", tests), tests[-3000:]
    assert "fit --print_config): status 0" in report and "GMC" in (out / "fit.txt").read_text(), report
    assert "Learner check (CPU mode: imports only)" in report, (out / "learner.log").read_text()[-2000:]
    assert int(re.search(r"Total: (\d+) s of 480 s", report).group(1)) <= 480
