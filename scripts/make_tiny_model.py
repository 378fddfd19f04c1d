"""Write the tiny random Llama checkpoint that ``configs/tiny-test.yaml`` serves.

    python scripts/make_tiny_model.py models/tiny-test

The same checkpoint the tests build (``tests/checkpoints.py``, family ``llama``): 2 layers,
vocabulary 320, random weights. It answers nonsense, fast; it exists to try the daemon's
plumbing (ports, probes, drain) without the default model. Skipped when present.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.checkpoints import make_checkpoint  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="checkpoint directory to create")
    out: Path = parser.parse_args().out
    if (out / "config.json").exists():
        print(f"{out} present: skipped")
        return 0
    partial = out.with_name(out.name + ".partial")
    make_checkpoint("llama", partial)
    partial.rename(out)
    print(f"tiny test checkpoint written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
