#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py) as one command line, for the device machine of the tool library:
#
#   bash benchmarks/gpu_check.sh [gpu_check.py flags]       # device run: timeout_s=330, then give_back
#
# That machine reaches no network. Its image holds python3 with a CUDA build of torch, attrs and
# cloudpickle, which is all elastic needs at run time; elastic itself runs from this tree's src/ (on
# PYTHONPATH, which the spawned ranks inherit: what an editable install gives, without the build backend
# it would need offline). Wheels carried in .whl/ (the device README says how) are installed first.
# Checkpoints go to $GPU_CHECK_DIR (default: .gpu_check/ in the tree, on the machine's disk; removed at
# the end); the log also goes to $OUT/gpu_check.log when the tool's $OUT is set. The run is stopped after
# $GPU_CHECK_LIMIT seconds (default 300: room for a second run within the device time).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$py" - <<'PY'
import importlib.util
import sys

missing = [m for m in ("torch", "attrs", "cloudpickle") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"gpu_check.sh: {', '.join(missing)} missing here; carry their wheels in .whl/ (device README)")
import torch

print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"available {torch.cuda.is_available()}, NCCL {torch.cuda.is_available() and torch.cuda.nccl.version()}")
PY
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not available"
dir=${GPU_CHECK_DIR:-$PWD/.gpu_check}
mkdir -p "$dir"
df -h "$dir" | tail -n 1
log=${OUT:-${TMPDIR:-/tmp}}/gpu_check.log
set +e
timeout -k 15 "${GPU_CHECK_LIMIT:-300}" "$py" benchmarks/gpu_check.py --dir "$dir" "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
set -e
rm -rf "$dir"
[ "$rc" = 124 ] && echo "gpu_check.sh: stopped after ${GPU_CHECK_LIMIT:-300} s; rerun with smaller --ckpt-gib/--model-gib"
exit "$rc"
