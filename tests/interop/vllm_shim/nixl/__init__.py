"""``nixl`` as vLLM imports it (``nixl._api``, ``nixl._bindings``), re-exporting the pinned
``nixl_cu12`` build: `make vllm-deps` copies this package into the vLLM interop environment.
NIXL's ``nixl`` meta package would pick a build by the CUDA it detects; this one never does.
"""

import importlib
import sys

for _name in ("_api", "_bindings", "_utils", "logging"):
    sys.modules[f"{__name__}.{_name}"] = importlib.import_module(f"nixl_cu12.{_name}")
