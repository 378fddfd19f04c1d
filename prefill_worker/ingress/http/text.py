"""The model's tokenizer, for requests that send ``text`` and for the first token's text.

Optional: a model directory without ``tokenizer.json`` (or a host without the ``tokenizers``
package) serves ``input_ids`` only, and ``text`` is refused with 400. Encoding follows
SGLang's server: the tokenizer's own special tokens are added (a BOS where the model has one).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

log = logging.getLogger(__name__)


class TextCodec(Protocol):
    max_token_bytes: int  # the longest token's text, in UTF-8 bytes: bounds a text's tokens

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


class HfTokenizer:
    """``tokenizers.Tokenizer`` from a ``tokenizer.json`` (fast, no transformers import)."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(path))
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        # Byte-level vocabularies spell a byte as one or two characters: an upper bound.
        self.max_token_bytes = max((len(token.encode()) for token in vocab), default=1)

    def encode(self, text: str) -> list[int]:
        """``encode_batch`` of one: unlike ``encode`` it releases the GIL while it works, so
        the worker's other threads (the ZMQ ingress, the engine) run meanwhile."""
        [encoding] = self._tokenizer.encode_batch([text], add_special_tokens=True)
        return list(encoding.ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(token_ids), skip_special_tokens=False))


def load_text_codec(model_dir: str | Path) -> TextCodec | None:
    """The directory's tokenizer, or None (logged) when it has none or cannot be read."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        log.info("%s has no tokenizer.json: the HTTP API takes input_ids only", model_dir)
        return None
    try:
        return HfTokenizer(path)
    except ImportError:
        log.warning("the tokenizers package is missing: the HTTP API takes input_ids only")
    except Exception as exc:  # a broken file must not stop the worker: text is refused instead
        log.warning("cannot read %s (%s): the HTTP API takes input_ids only", path, exc)
    return None
