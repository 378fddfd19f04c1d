"""What ``check-config`` can tell about a configuration from its checkpoint's ``config.json``,
without loading weights or touching a device: the architecture is one we serve, weights are
there, and the KV pool's arithmetic (bytes per token, pages, tokens) holds the longest prompt.

The checkpoint directory is often absent where configurations are checked (CI, a laptop, a
container build): then the configuration is still checked and valid, and a note says the
checkpoint was not; ``check-config --require-model`` makes the absence an error. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from prefill_worker.kv.layout import DTYPE_ITEMSIZE, KVLayout
from prefill_worker.model.hf_config import CheckpointError, ModelSpec, read_spec
from prefill_worker.service.schema import Config

_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


@dataclass(frozen=True, slots=True)
class ModelCheck:
    problems: list[str] = field(default_factory=list)  # each one line; any means exit 78
    notes: list[str] = field(default_factory=list)  # what was checked, what was not


def check_model(config: Config, require_model: bool = False) -> ModelCheck:
    path = Path(config.model.path)
    if not path.is_dir():
        absent = f"model.path {str(path)!r} is not a directory here"
        if require_model:
            return ModelCheck(problems=[absent])
        return ModelCheck(notes=[f"{absent}: its checkpoint was not checked"])
    try:
        spec = read_spec(path)
    except CheckpointError as exc:
        return ModelCheck(problems=[str(exc)])
    check = ModelCheck()
    if not any((path / name).exists() for name in _WEIGHT_FILES):
        check.problems.append(f"{path}: neither {' nor '.join(_WEIGHT_FILES)} found")
    _check_pool(config, spec, check)
    return check


def _check_pool(config: Config, spec: ModelSpec, check: ModelCheck) -> None:
    dtype: str = config.model.dtype
    if dtype == "auto":
        dtype = spec.torch_dtype if spec.torch_dtype in DTYPE_ITEMSIZE else "float32"
    cache = config.cache
    page = KVLayout(spec.num_layers, spec.num_kv_heads, spec.head_dim, dtype, cache.page_size, 1)
    bytes_per_page = 2 * spec.num_layers * page.page_bytes  # K and V of every layer
    check.notes.append(
        f"model: {spec.architecture}, {spec.num_layers} layers, {spec.num_kv_heads} KV heads × "
        f"{spec.head_dim}, {dtype}: {bytes_per_page // cache.page_size} bytes of KV per token"
    )
    longest = min(config.scheduler.max_prompt_tokens, spec.max_position)
    if config.scheduler.max_prompt_tokens > spec.max_position:
        check.notes.append(
            f"scheduler.max_prompt_tokens {config.scheduler.max_prompt_tokens} is capped at the "
            f"model's {spec.max_position}"
        )
    num_pages = cache.num_pages
    if num_pages is None and cache.memory_bytes is not None:
        num_pages = cache.memory_bytes // bytes_per_page
    if num_pages is None:
        check.notes.append("KV pool: sized from free device memory at start-up (memory_fraction)")
        return
    num_tokens = num_pages * cache.page_size
    check.notes.append(
        f"KV pool: {num_pages} pages × {cache.page_size} tokens = {num_tokens} tokens, "
        f"{num_pages * bytes_per_page / 2**30:.2f} GiB"
    )
    if num_tokens < longest:
        check.problems.append(
            f"the KV pool holds {num_tokens} tokens, fewer than the longest prompt accepted "
            f"({longest}): raise cache.num_pages or cache.memory_bytes"
        )
