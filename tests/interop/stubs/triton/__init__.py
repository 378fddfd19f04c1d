"""Stand-in for triton (tests/interop/stubs/README.md): imported by SGLang, never run on CPU."""

from _stubtools import install

__version__ = "3.4.0"
install(__name__)
