#!/usr/bin/env bash
# One short, prepared GPU check of the vLLM engine (issue 4): the CUDA tests (colocated sleep/wake + bf16 sync,
# the dedicated layout when a second GPU exists, a 4-step tiny fit) and the rollout benchmark.
# Needs an environment with GPU vLLM: pip install -e ".[dev,vllm]". Run from the repository root:
#   bash scripts/gpu_check.sh            # results also copied to $OUT when it is set
# Budget: ~2 min for the vLLM start-ups and tests, ~1-2 min for the benchmark on one H100/H200.
set -uo pipefail
out="${OUT:-/tmp/gpu_check}"
mkdir -p "$out"
python - <<'PY' 2>&1 | tee "$out/env.txt"
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())
print([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
import vllm, transformers
print("vllm", vllm.__version__, "transformers", transformers.__version__)
PY
timeout 420 python -m pytest tests/test_cuda_paths.py -m cuda -q -rA -p no:cacheprovider 2>&1 | tail -40 | tee "$out/tests.txt"
timeout 300 python scripts/bench_rollout.py --models tiny mid --engines hf vllm --repeats 2 2>&1 \
  | grep -vE " (INFO|DEBUG|WARNING) " | tail -20 | tee "$out/bench.txt"
