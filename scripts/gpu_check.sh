#!/usr/bin/env bash
# One prepared GPU check, ~9 minutes on one H100/H200, in three parts (each can also run alone):
#   tests  the CUDA tests: vLLM colocated sleep/wake + bf16 sync, the dedicated layout when a second GPU exists, a
#          4-step tiny fit (issue 4); 8-bit AdamW keeping lr-1e-6 updates on fp32 masters, and its state sizes
#          against scripts/memory_estimate.py (issue 10).                                       limit TESTS_S=200 s
#   bench  rollout throughput of the HF and vLLM engines and the weight-sync latency (issue 4).  limit BENCH_S=100 s
#   scale  3 updates of a random Qwen3-1.7B-width model with the Qwen3 configs' precision (fp32 masters under
#          bf16-mixed), bitsandbytes 8-bit AdamW and colocated bf16 vLLM: tokens/s, update time, peak memory,
#          engine/learner log-prob gap; then the memory estimate for the same lengths (issue 10). limit SCALE_S=240 s
# Needs an environment with GPU vLLM and bitsandbytes: pip install -e ".[dev,vllm]". From the repository root:
#   bash scripts/gpu_check.sh                # all three parts
#   bash scripts/gpu_check.sh scale          # only the named parts
# Results go to $OUT (default /tmp/gpu_check): gpu_check.md collects the figures; env.txt, tests.txt, bench.txt and
# scale.log are the raw outputs. A part that fails or runs out of time leaves what it wrote and the next part runs.
set -uo pipefail
out="${OUT:-/tmp/gpu_check}"
mkdir -p "$out"
parts=" ${*:-tests bench scale} "
report="$out/gpu_check.md"
echo "# GPU check, $(date -u +%Y-%m-%dT%H:%MZ), parts:${parts% }" > "$report"

python - <<'PY' 2>&1 | tee "$out/env.txt"
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())
print([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
import vllm, transformers
print("vllm", vllm.__version__, "transformers", transformers.__version__)
import bitsandbytes
print("bitsandbytes", bitsandbytes.__version__)
PY
{ echo; echo '```'; cat "$out/env.txt"; echo '```'; } >> "$report"

if [[ $parts == *" tests "* ]]; then
  timeout "${TESTS_S:-200}" python -m pytest tests/test_cuda_paths.py tests/test_precision.py \
    tests/test_memory_estimate.py -m cuda -q -rA -p no:cacheprovider 2>&1 | tail -40 | tee "$out/tests.txt"
  { echo; echo "## CUDA tests"; echo '```'; grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|[0-9]+ (passed|failed|skipped|deselected|errors?)" "$out/tests.txt"
    echo '```'; } >> "$report"
fi

if [[ $parts == *" bench "* ]]; then
  timeout "${BENCH_S:-100}" python scripts/bench/bench_rollout.py --models tiny mid --engines hf vllm --repeats 2 2>&1 \
    | grep -vE " (INFO|DEBUG|WARNING) " | tail -20 | tee "$out/bench.txt"
  { echo; echo "## Rollout benchmark (scripts/bench/bench_rollout.py)"; echo '```'; cat "$out/bench.txt"; echo '```'; } \
    >> "$report"
fi

if [[ $parts == *" scale "* ]]; then
  # The script appends its rows to the report as it measures them, so a timeout keeps the updates already done.
  timeout "${SCALE_S:-240}" python scripts/gpu_scale_check.py --out "$report" --completion-tokens 2048 --steps 3 \
    > "$out/scale.log" 2>&1 || { rc=$?; echo; echo "gpu_scale_check.py stopped with status $rc (124: time limit;" \
      "see scale.log):"; echo '```'; tail -15 "$out/scale.log"; echo '```'; } >> "$report"
  { echo; echo "### Learner memory estimated for the same lengths (scripts/memory_estimate.py)"; echo
    python scripts/memory_estimate.py --models 1.7B --completion-tokens 2048 --fsdp; } >> "$report" 2>&1
fi
cat "$report"
