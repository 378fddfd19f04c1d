#!/usr/bin/env bash
# Downloads, here, the wheels scripts/gpu_check.sh needs on a CUDA machine that has no
# registry (it has torch, transformers, numpy, msgpack, pyyaml, safetensors, uvloop).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude || echo '/.whl/' >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl \
  flashinfer-python pydantic pydantic-core annotated-types typing-inspection pyzmq \
  prometheus-client
ls -la .whl
