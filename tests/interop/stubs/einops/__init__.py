"""Stand-in for einops (tests/interop/stubs/README.md): imported by the model layers SGLang's
``disaggregation/decode.py`` pulls in (its DP-rank resolution, ``test_dp_attention.py``),
never run."""

from _stubtools import install

__version__ = "0.8.1"
install(__name__)
