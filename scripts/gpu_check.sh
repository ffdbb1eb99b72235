#!/usr/bin/env bash
# The GPU check for the machine this project can be lent: one H200, no network, 64 MiB carried over, a Python with
# torch 2.11, Lightning 2.6.6, transformers 5.17, tensorboard (torchmetrics with Lightning), but no vLLM,
# bitsandbytes, jsonargparse, datasets, math-verify, pebble or matplotlib. Two steps (docs/gpu_check.md says how
# to run them through the device tool):
#
#   bash scripts/gpu_check.sh prepare   on a machine with the package index: downloads the pure-Python wheels the
#                                       GPU machine lacks (WHEELS below, at the versions installed here) into
#                                       .whl/ (ignored by git, checked to stay under 64 MiB)
#   bash scripts/gpu_check.sh run       on the GPU machine, from the repository root with .whl/ beside it: a venv over
#                                       the system's packages, the wheels and this package installed --no-deps
#                                       --no-index, then one Markdown report in $OUT/gpu_check.md. Everything, the
#                                       venv and the install included, runs under one limit, TOTAL_S=480 s (8
#                                       minutes); each part also has its own and gets at most what is left:
#     install  the venv, the wheels and this package                                          limit INSTALL_S=90 s
#     tests    the cuda-marked tests (those needing vLLM or bitsandbytes skip, saying so)     limit TESTS_S=90 s
#     fit      a 30-update tiny fit on the GPU through `python -m lit_gmc fit`               limit FIT_S=120 s
#     learner  scripts/gpu_learner_check.py: one learner update of random Qwen3-1.7B and 4B-shaped models at
#              8 x 5,120 tokens (bf16-mixed, fp32 masters, gradient checkpointing, torch fused AdamW): peak memory
#              against scripts/memory_estimate.py, step time, MFU; HFEngine generation tokens/s   what is left
#   bash scripts/gpu_check.sh run learner   only the named parts
# WHEELS_DIR overrides .whl/. VENV names the venv (default /tmp/lit_gmc_gpu_venv); one that exists already is used as
# it is, the wheels installed into it (CI's stand-in for the machine's Python). CPU=1 is the CPU mode CI runs: the
# same steps, the tests collected and imported (their cuda ones skip without a GPU), the CLI's config parsed
# (`fit --print_config`) instead of a fit, and the learner script's imports only (`--help`). A part that fails or runs out of time leaves what it wrote and the next part runs.
set -uo pipefail
WHEELS="jsonargparse docstring-parser typeshed-client math-verify latex2sympy2_extended antlr4-python3-runtime pebble
rich markdown-it-py mdurl pygments pytest pluggy iniconfig exceptiongroup tomli setuptools"
wheels="${WHEELS_DIR:-.whl}"
limit_bytes=$((64 << 20))

prepare() {
  rm -rf "$wheels" && mkdir -p "$wheels"
  # Each at the version installed here (the one the tests ran with); absent here (exceptiongroup and tomli, needed
  # by pytest on Python 3.10): the newest.
  python - $WHEELS > "$wheels/requirements.txt" <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, version
for name in sys.argv[1:]:
    try:
        print(f"{name}=={version(name)}")
    except PackageNotFoundError:
        print(name)
PY
  # Pure-Python builds only (tomli, say, also ships compiled ones), good for Python 3.10 (the project's floor) on.
  python -m pip download --quiet --no-deps --only-binary=:all: --platform any --implementation py --abi none \
    --python-version 3.10 --dest "$wheels" -r "$wheels/requirements.txt" || exit 1
  local size
  size=$(du -sb "$wheels" | cut -f1)
  ls "$wheels"
  echo "$wheels: $size bytes"
  if ((size >= limit_bytes)); then echo "$wheels is over 64 MiB: the device tool carries 64 MiB in all" >&2; exit 1; fi
  if ls "$wheels"/*.whl | grep -v -- "-none-any.whl$"; then echo "the wheels above are not pure Python" >&2; exit 1; fi
}

run() {
  local out="${OUT:-/tmp/gpu_check}" parts=" ${*:-tests fit learner} " cpu="${CPU:-0}"
  local report="$out/gpu_check.md" venv="${VENV:-/tmp/lit_gmc_gpu_venv}" deadline=$((SECONDS + ${TOTAL_S:-480}))
  # The seconds a step may take: its own limit, or what is left of the overall one (a few kept for the report).
  limit() { local left=$((deadline - SECONDS - 5)); ((left < $1)) && echo $((left > 0 ? left : 1)) || echo "$1"; }
  mkdir -p "$out"
  ls "$wheels"/*.whl > /dev/null \
    || { echo "no wheels in $wheels: run 'bash scripts/gpu_check.sh prepare' first (and carry it)" >&2; exit 1; }
  # Without ensurepip, a venv without pip still reaches the system's pip through the system site-packages.
  if [[ ! -x $venv/bin/python ]]; then
    { timeout "$(limit 30)" python -m venv --system-site-packages "$venv" \
        || timeout "$(limit 30)" python -m venv --without-pip --system-site-packages "$venv"; } || exit 1
  fi
  . "$venv/bin/activate" || exit 1
  local install_s
  install_s=$(limit "${INSTALL_S:-90}")
  timeout "$install_s" bash -c 'python -m pip install --quiet --no-index --no-deps "$1"/*.whl \
      && python -m pip install --quiet --no-index --find-links "$1" --no-deps .' _ "$wheels" > "$out/install.txt" 2>&1 \
    || { cat "$out/install.txt"; echo "install failed or passed its ${install_s} s" >&2; exit 1; }
  echo "# GPU check, $(date -u +%Y-%m-%dT%H:%MZ), parts:${parts% }$( ((cpu)) && echo ', CPU mode')" > "$report"
  timeout "$(limit 60)" python - > "$out/env.txt" 2>&1 <<'PY'
import sys
import torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
for name in ("lightning", "transformers", "jsonargparse", "torchmetrics", "vllm", "bitsandbytes", "datasets",
             "matplotlib"):
    try:
        print(name, __import__(name).__version__)
    except ImportError:
        print(name, "absent")
import lit_gmc.cli, lit_gmc.data.datamodule, lit_gmc.callbacks.evaluation  # the package imports as installed
print("lit_gmc imports")
PY
  { echo; echo '```'; cat "$out/env.txt"; echo '```'; } >> "$report"

  if [[ $parts == *" tests "* ]]; then
    timeout "$(limit "${TESTS_S:-90}")" python -m pytest tests/test_cuda_paths.py tests/test_precision.py \
      tests/test_memory_estimate.py tests/test_diagnostics.py tests/test_hf_engine.py -m cuda -q -rA \
      -p no:cacheprovider > "$out/tests.txt" 2>&1
    { echo; echo "## CUDA tests"; echo '```'
      grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|[0-9]+ (passed|failed|skipped|deselected|errors?)" "$out/tests.txt"
      echo '```'; } >> "$report"
  fi

  if [[ $parts == *" fit "* ]]; then
    local start=$SECONDS rc
    if ((cpu)); then  # the CLI and the embedded default config, parsed and printed; no training
      timeout "$(limit "${FIT_S:-120}")" python -m lit_gmc fit --print_config > "$out/fit.txt" 2>&1
      rc=$?
      { echo; echo "## CLI (CPU mode: python -m lit_gmc fit --print_config): status $rc, $((SECONDS - start)) s"
        echo '```'; grep -E "^(model|data|trainer):|correction|schedule" "$out/fit.txt" | head -8; tail -3 "$out/fit.txt"
        echo '```'; } >> "$report"
    else
      timeout "$(limit "${FIT_S:-120}")" python -m lit_gmc fit --trainer.accelerator gpu --trainer.max_steps 30 \
        --trainer.logger.init_args.save_dir "$out/runs" --trainer.enable_progress_bar false > "$out/fit.txt" 2>&1
      rc=$?
      { echo; echo "## Tiny fit on the GPU (python -m lit_gmc fit, 30 updates): status $rc, $((SECONDS - start)) s"
        echo '```'; timeout "$(limit 30)" python - "$out/runs" <<'PY'
import sys
from pathlib import Path
from lit_gmc.tblog import read_scalars
folders = sorted(Path(sys.argv[1]).rglob("version_*"))
scalars = read_scalars(folders[-1]) if folders else {}
for tag in ("train/reward", "train/loss", "diag/gap/token_abs_max", "mismatch/abs_max"):
    values = [v for _, v in scalars.get(tag, [])]
    print(tag, f"{len(values)} updates, first {values[0]:.4g}, last {values[-1]:.4g}" if values else "not logged")
PY
        tail -5 "$out/fit.txt"; echo '```'; } >> "$report" 2>&1
    fi
  fi

  if [[ $parts == *" learner "* ]]; then
    local learner_args=(--out "$report") rc
    ((cpu)) && learner_args=(--help)  # the script and its imports, no model
    # The script appends one row per model as soon as it is measured, so a timeout keeps the rows already done.
    timeout "$(limit "${LEARNER_S:-$((deadline - SECONDS))}")" python scripts/gpu_learner_check.py \
      "${learner_args[@]}" > "$out/learner.log" 2>&1
    rc=$?
    if ((rc)); then
      { echo; echo "gpu_learner_check.py stopped with status $rc (124: time limit; see learner.log):"
        echo '```'; tail -15 "$out/learner.log"; echo '```'; } >> "$report"
    elif ((cpu)); then
      { echo; echo "## Learner check (CPU mode: imports only)"; echo '```'; head -3 "$out/learner.log"
        echo '```'; } >> "$report"
    fi
  fi
  echo >> "$report"
  echo "Total: $((SECONDS - deadline + ${TOTAL_S:-480})) s of ${TOTAL_S:-480} s" >> "$report"
  cat "$report"
}

case "${1:-}" in
  prepare) prepare ;;
  run) shift; run "$@" ;;
  *) echo "usage: bash scripts/gpu_check.sh prepare | run [tests] [fit] [learner]" >&2; exit 2 ;;
esac
