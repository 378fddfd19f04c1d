#!/usr/bin/env bash
# Packs, here, what scripts/gpu_check.sh needs on the lent CUDA machine, which has no registry
# (it has Python 3.12, CUDA 13 torch, transformers, numpy, msgpack, pyyaml, safetensors,
# uvloop, aiohttp) into .whl/ (git-ignored), under the device tool's 64 MiB carry limit:
#   - NIXL for CUDA 13 (nixl-cu13, matching that torch), as a .tar.xz of its unpacked wheel
#     without nixl_ep (expert-parallel kernels, 91 MB) and UCX's perftest: 18 MB where the
#     wheel is 59 MB (and nixl-cu12's 69 MB), so it fits;
#   - flashinfer-python 0.6.13 (14 MB: JIT sources; the prebuilt flashinfer-cubin is 458 MB
#     and cannot travel, so kernels compile with nvcc there on first use);
#   - what flashinfer 0.6.13 imports that the image lacks: apache-tvm-ffi, nvidia-cudnn-frontend
#     (nvidia-cutlass-dsl and cuda-tile are left out: large, and used only by kernels we do not
#     call; if flashinfer's import needs them there, the check says so and measures sdpa);
#   - pyzmq, pydantic and its parts, prometheus-client, msgspec.
# Then: device run, carry [".whl"], command "bash scripts/gpu_check.sh".
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude || echo '/.whl/' >> .git/info/exclude
rm -rf .whl && mkdir -p .whl
download() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 \
    --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$1" "${@:2}"
}
download .whl flashinfer-python==0.6.13 pydantic==2.14.4 pydantic-core==2.50.5 \
  annotated-types==0.8.0 typing-inspection==0.4.5 pyzmq==27.3.0 prometheus-client==0.26.0 \
  msgspec==0.23.0 'apache-tvm-ffi>=0.1.6,<0.2,!=0.1.8,!=0.1.8.post0' nvidia-cudnn-frontend==1.32.0
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
download "$work" nixl-cu13==1.5.1
(cd "$work" && mkdir site && cd site && python3 -m zipfile -e ../nixl_cu13-*.whl . \
  && rm -rf nixl_ep_cu13* && find . -name '*perftest*' -delete)
tar -C "$work/site" -cJf .whl/nixl-cu13-1.5.1-slim.tar.xz .
du -ch .whl/* | tail -1
