"""The built wheel installs ``lit_gmc`` with ``callbacks/`` and ``data/`` as ``lit_gmc.callbacks``/``lit_gmc.data``."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def public_modules(names: list[str]) -> list[str]:
    """Dotted names of the wheel's modules, packages included, private ``_x.py`` files and ``__main__`` excluded."""
    modules = []
    for name in names:
        path = Path(name)
        if path.suffix != ".py" or path.parts[0] != "lit_gmc":
            continue
        if path.name == "__init__.py":
            modules.append(".".join(path.parts[:-1]))
        elif not path.name.startswith("_"):
            modules.append(".".join(path.with_suffix("").parts))
    return sorted(modules)


@pytest.mark.slow
def test_wheel_installs_into_a_fresh_venv_and_every_public_module_imports(tmp_path):
    dist = tmp_path / "dist"
    build = subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist),
                            str(REPO)], capture_output=True, text=True, timeout=600)  # fmt: skip
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = dist.glob("lit_gmc-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert len(names) == len(set(names)), "a file packed twice (through the links in lit_gmc/?)"
    for expected in (
        "lit_gmc/callbacks/weight_sync.py",
        "lit_gmc/data/engines/hf.py",
        "lit_gmc/data/tasks/verifier.py",
        "lit_gmc/data/schedules/live.py",
        "lit_gmc/configs/tiny.yaml",
    ):
        assert expected in names, f"{expected} missing from the wheel"
    assert not any(n.startswith(("callbacks/", "data/", "configs/", "tests/")) for n in names), (
        "stray top-level package"
    )

    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    with zipfile.ZipFile(wheel) as zf:  # a wheel install is an unzip into site-packages (pip is not needed here)
        zf.extractall(site)
    modules = public_modules(names)
    # The dependencies (torch, lightning, ...) come from this interpreter's site-packages, placed *after* the
    # fresh venv's own, and the cwd is outside the repo, so `lit_gmc` can only resolve to the installed wheel.
    code = (
        "import importlib, sys, lit_gmc\n"
        f"assert lit_gmc.__file__.startswith({site!r}), lit_gmc.__file__\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print('imported', len(sys.modules))\n"
    )
    env = {**os.environ, "PYTHONPATH": sysconfig.get_paths()["purelib"]}
    run = subprocess.run([python, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "lit_gmc.callbacks.weight_sync" in modules and "lit_gmc.data.datamodule" in modules


@pytest.mark.parametrize("folder", ["data", "callbacks"])
def test_lit_gmc_links_the_top_level_folders_for_type_checkers(folder):
    """``lit_gmc/<folder>`` links to ``<folder>/``: editors and mypy resolve ``lit_gmc.<folder>`` in a clone."""
    link = REPO / "lit_gmc" / folder
    assert link.is_symlink() and link.resolve() == (REPO / folder).resolve()
