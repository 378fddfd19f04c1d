"""Stand-in for torchvision (tests/interop/stubs/README.md): PyPI's wheels need CUDA torch."""

from _stubtools import install

__version__ = "0.28.0"
install(__name__)
