#!/usr/bin/env bash
# The GPU checks, as one prepared command for a lent CUDA machine (see the device tool).
# That machine has CUDA torch, transformers and msgpack but no registry: the rest travels
# as wheels that `scripts/gpu_wheels.sh` downloads here into .whl/ (carry it).
#   run: bash scripts/gpu_check.sh      (with carry: [".whl"])
# Prints: the gpu-marked tests (flashinfer against sdpa, kernel level and whole model) and the
# runner-vs-transformers tests on CUDA. Never run it in CI (CI has no GPU).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, flashinfer; print('torch', torch.__version__, 'flashinfer', flashinfer.__version__)"
status=0
python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu || status=1
python3 -m pytest -q -p no:cacheprovider tests/integration/model || status=1
exit $status
