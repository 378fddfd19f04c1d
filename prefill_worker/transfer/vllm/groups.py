"""vLLM's KV-cache groups for a sliding-window model (gpt-oss, Gemma 3), as a vLLM 0.34 decode
with its hybrid KV-cache manager (HMA, on by default) builds them, and what this worker says
of them: each layer's group in the handshake metadata (``layer_group_ids``,
``region_group_ids``) and one block list per group in the answer's ``remote_block_ids``.
Pure functions, no torch.

vLLM groups the layers by KV-cache spec (``kv_cache_planning._get_kv_cache_groups_uniform_page
_size``): a bucket per spec in the order its first layer appears (full attention, and one
sliding window), all buckets split into groups of ``group_size`` layers, ``group_size`` the
smallest bucket's size (the largest's when it is under 1.5x the smallest), bucket ``b``'s
``n`` groups taking ``layers[i::n]``. The decode's pull pairs our regions with its own by layer
name and refuses a layer whose group differs here (``base_worker._pair_regions``); a model of
one spec is one group (0)::

    gpt-oss, 3 layers (sliding, full, sliding)      groups [L0] [L2] [L1]
    Gemma 3, 4 layers (sliding, full, sliding x2)   groups [L0] [L2] [L3] [L1]
    gpt-oss-20b, 24 layers alternating              groups [L0 L2 .. L22] [L1 L3 .. L23]

A sliding group's block list is the request's last ``cdiv(sliding_window, block_size) + 1``
blocks, as vLLM's own prefill clips it (``base_scheduler.get_exchange_clipped_blocks``) and its
decode clips its own; the decode pairs the two lists from the end (``_apply_prefix_caching``).
The staging blocks hold every position of every layer (the KV mirror writes them all); a
sliding layer's are read only in the window's blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from prefill_worker.transfer.swa_window import SlidingLayers

FULL_ATTENTION = None  # a layer's window in ``layer_windows``: no window
LINEAR = "linear"  # a linear-attention (GDN) layer: vLLM's ``MambaSpec``, one state block

# vLLM's attention layer names (its model files' prefixes), by architecture: the name each
# region is advertised under, which the decode pairs by.
_ATTN_SUFFIX = {"GptOssForCausalLM": "attn.attn"}
_DEFAULT_ATTN_SUFFIX = "self_attn.attn"


def layer_names(architecture: str | None, num_layers: int) -> tuple[str, ...]:
    """vLLM's name of each layer's attention for ``architecture`` (None: as for Llama)."""
    suffix = _ATTN_SUFFIX.get(architecture or "", _DEFAULT_ATTN_SUFFIX)
    return tuple(f"model.layers.{i}.{suffix}" for i in range(num_layers))


@dataclass(frozen=True, slots=True)
class VllmGroups:
    """A model's layers as vLLM's KV-cache groups: ``layer_group[l]``, layer ``l``'s group;
    ``window_blocks[g]``, the blocks group ``g`` keeps of a request (None: every one, a full
    attention group); ``names``, the layers' attention names."""

    layer_group: tuple[int, ...]
    window_blocks: tuple[int | None, ...]
    names: tuple[str, ...]
    state_layers: tuple[int, ...] = ()  # the linear layers (their state, not KV)

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers of the KV list (the staging region's layers), in model order."""
        return tuple(i for i in range(len(self.names)) if i not in self.state_layers)

    @property
    def num_groups(self) -> int:
        return len(self.window_blocks)

    @property
    def full_groups(self) -> tuple[int, ...]:
        """The full-attention groups (every block kept): the ones whose blocks are a prefix."""
        return tuple(g for g, n in enumerate(self.window_blocks) if n is None)

    def block_ids(self, blocks: Sequence[int]) -> list[list[int]]:
        """``remote_block_ids``: a request's staging blocks (in prompt order) per group."""
        return [list(blocks) if n is None else list(blocks[-n:]) for n in self.window_blocks]


def one_group(names: Sequence[str]) -> VllmGroups:
    """A model whose layers share one spec: one group, every block."""
    return VllmGroups((0,) * len(names), (None,), tuple(names))


def hma_groups(
    layer_windows: Sequence[int | str | None], block_size: int, names: Sequence[str]
) -> VllmGroups:
    """vLLM 0.34's groups of layers whose sliding window (the model config's
    ``sliding_window``) is ``layer_windows[l]`` (``FULL_ATTENTION``: none; ``LINEAR``: a
    linear layer, whose group sends the one block holding its state)."""
    if len(names) != len(layer_windows) or block_size < 1:
        raise ValueError(f"{len(names)} names for {len(layer_windows)} layers")
    buckets: dict[int | str | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        buckets.setdefault(window, []).append(layer)
    sizes = [len(layers) for layers in buckets.values()]
    group_size = max(sizes) if max(sizes) < min(sizes) * 1.5 else min(sizes)
    layer_group = [0] * len(layer_windows)
    windows: list[int | str | None] = []
    for window, layers in buckets.items():
        num_groups = -(-len(layers) // group_size)
        for i in range(num_groups):
            for layer in layers[i::num_groups]:
                layer_group[layer] = len(windows)
            windows.append(window)
    window_blocks = tuple(_blocks_kept(w, block_size) for w in windows)
    state = tuple(i for i, w in enumerate(layer_windows) if w == LINEAR)
    return VllmGroups(tuple(layer_group), window_blocks, tuple(names), state)


def _blocks_kept(window: int | str | None, block_size: int) -> int | None:
    if window is None:
        return None
    if window == LINEAR:
        return 1  # vLLM's clip_ssm_state_blocks: the state-bearing block
    assert isinstance(window, int)
    return -(-window // block_size) + 1


def sliding_groups(layers: SlidingLayers, architecture: str, block_size: int) -> VllmGroups:
    """vLLM 0.34's groups of a sliding-window model (``SlidingLayers``, whose
    ``window_tokens`` is the config's ``sliding_window`` less one: ``swa_window``)."""
    window = layers.window_tokens + 1
    windows = [window if i in layers.sliding else FULL_ATTENTION for i in range(layers.num_layers)]
    return hma_groups(windows, block_size, layer_names(architecture, layers.num_layers))


def linear_groups(linear_layers: Sequence[int], num_layers: int, block_size: int) -> VllmGroups:
    """vLLM 0.34's groups of a Qwen3-Next / Qwen3.5 model: ``linear_layers`` (model ids) are
    its GDN layers (``model.layers.<i>.linear_attn``), the others full attention."""
    kinds = [LINEAR if i in linear_layers else FULL_ATTENTION for i in range(num_layers)]
    names = [
        f"model.layers.{i}.linear_attn"
        if i in linear_layers
        else f"model.layers.{i}.self_attn.attn"
        for i in range(num_layers)
    ]
    return hma_groups(kinds, block_size, names)
