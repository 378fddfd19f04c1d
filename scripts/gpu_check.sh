#!/usr/bin/env bash
# The GPU checks, as one prepared command for a lent CUDA machine (see the device tool).
#   here:  bash scripts/gpu_wheels.sh                  (packs .whl/, under 64 MiB)
#   there: bash scripts/gpu_check.sh                   (device run, carry [".whl"])
#   here:  bash scripts/gpu_check.sh --dry-run         (the same steps on CPU: the plumbing)
# Runs bench/gpu.py (8B-shaped prefill MFU at 1k/4k/16k tokens and a VRAM→VRAM NIXL push
# between two processes) into bench/results/gpu.json, then the gpu-marked tests (flashinfer
# against sdpa, whole model on CUDA; flashinfer's MLA against the torch MLA path and
# DeepSeek-V3 tiny against transformers: test_mla_cuda.py) and the runner against
# transformers on CUDA; the JSON is copied to $OUT when the device tool sets it; last, the
# flashinfer MoE against grouped (test_moe_cuda.py), only where flashinfer-jit-cache is installed:
# without it the fused CUTLASS MoE module compiles from source (~20 .cu files plus
# generated kernels for every dtype pair: read from its JIT spec, not timed), expected to
# take far longer than this check may, and that wheel is far over the carry limit, so on
# the lent machine the step says NOT RUN.
# The bench takes about 2 minutes on an H200 (flashinfer's prefill module compiled on first
# use included); the tests compile one module per shape: on the first lent H200 (2026-12-04)
# five took 7 minutes, so the whole check wants the device tool's 10-minute command limit and
# a second run for the rest (the compiled modules stay in ~/.cache/flashinfer while the
# machine is warm). Never in CI (CI has no GPU).
set -uo pipefail
cd "$(dirname "$0")/.."
dry_run=0
[ "${1:-}" = "--dry-run" ] && dry_run=1
export PYTHONUNBUFFERED=1 NIXL_LOG_LEVEL=WARN
# flashinfer's JIT: build for this device's architecture only, with every core.
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
PY=python3
if [ "$dry_run" = 1 ]; then
  PY=${PYTHON:-.venv/bin/python}
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
elif [ -d .whl ]; then
  mkdir -p /tmp/site
  for t in .whl/*.tar.xz; do tar -C /tmp/site -xJf "$t" || exit 1; done
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
status=0
step() { echo "== $* ($(date +%T))"; }
if [ "$dry_run" = 1 ]; then
  step "gpu tests: collected (they skip without CUDA)"
  $PY -m pytest -q -p no:cacheprovider -m gpu --collect-only tests/gpu | tail -1 || status=1
  step "bench/gpu.py --dry-run (tiny model and 1 MiB push on CPU)"
  $PY bench/gpu.py --dry-run --out "${GPU_CHECK_OUT:-/tmp/gpu-dry-run.json}" || status=1
else
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
  arch=$($PY -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")
  export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-$arch} \
    TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$arch}
  $PY -c "import flashinfer; print('flashinfer', flashinfer.__version__)" \
    || echo "flashinfer does not import: its tests fail below and bench/gpu.py measures sdpa"
  # The numbers first: the tests below compile one flashinfer module per shape they try
  # (about a minute each with nvcc; 5 tests took 7 minutes on the first lent H200).
  step "bench/gpu.py"
  $PY bench/gpu.py || status=1
  [ -n "${OUT:-}" ] && cp bench/results/gpu.json "$OUT/" 2>/dev/null
  step "gpu tests"
  $PY -m pytest -q -p no:cacheprovider -m gpu tests/gpu --ignore=tests/gpu/test_moe_cuda.py \
    -rf --tb=line || status=1
  step "runner against transformers (CUDA where the tests take a device)"
  $PY -m pytest -q -p no:cacheprovider tests/integration/model/test_runner_vs_hf.py || status=1
  if $PY -c "import flashinfer_jit_cache" 2>/dev/null; then
    step "flashinfer MoE against grouped"
    $PY -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_moe_cuda.py || status=1
  else
    step "flashinfer MoE against grouped: NOT RUN (no flashinfer-jit-cache: its CUTLASS MoE"
    echo "   kernels would compile from source, every dtype pair, far past this check's time)"
  fi
fi
step "done: exit $status"
exit $status
