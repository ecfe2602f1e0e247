#!/usr/bin/env bash
# The checks that need a GPU, in one command on a machine with CUDA and a torch built for it:
#
#     bash tests/gpu_check.sh [OUT_DIR]
#
# No install: the checkout's src is put on the path of the python3 found first (override with
# PYTHON=...). Runs the tests that skip without CUDA (CUDA-event timing; the whole API on
# cuda:0 shared by 3 gloo workers, SyncBatchNorm included; nccl with one worker per GPU), then
# the example script on nccl with one worker per GPU. Logs go to OUT_DIR (default: a new
# temporary folder). Exits non-zero if anything fails.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-$(mktemp -d)}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONPATH="$PWD/src:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
gpus=$("$py" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)') ||
    { echo "gpu_check: $py cannot import torch (set PYTHON=...)" >&2; exit 1; }
if [ "$gpus" -lt 1 ]; then
    echo "gpu_check: no CUDA device visible to $py" >&2
    exit 1
fi
"$py" -c 'import torch; print("torch", torch.__version__, "on", torch.cuda.get_device_name(0))'
"$py" -m pytest -q -rs -p no:cacheprovider tests/test_timing.py tests/test_runtime_dist.py \
    2>&1 | tee "$out/pytest.log"
"$py" -m torch.distributed.run --standalone --nproc-per-node="$gpus" examples/train_mlp.py \
    --epochs 1 2>&1 | tee "$out/example.log"
grep -q "backend nccl" "$out/example.log" || { echo "gpu_check: the example did not run on nccl" >&2; exit 1; }
echo "gpu_check: passed; logs in $out"
