"""Write the golden checkpoints under ``tests/golden/v<FORMAT_VERSION>/`` with the code of this tree.

The golden checkpoints prove that a checkpoint written by an earlier release still loads:
`tests/checkpoint/test_golden.py` loads them into fresh states and checks every value against
`golden_state.build()`.
They are committed and never regenerated for an existing format version. A change to the format must keep
loading them, or bump the format version (`checkpoint.manifest.FORMAT_VERSION` or
`checkpoint.codec.CONTENT_VERSION`) with
a migration, and then add a directory for the new version with this script (keeping the old ones).

- ``full/``: every field, including two objects (a `golden_state.Point` and a `fractions.Fraction`), so it
  loads only with ``trusted=True``;
- ``plain/``: the same state with the object fields set to None: plain data and tensors only.

Run from the repository root: ``PYTHONPATH=src python tests/golden/make_golden.py [--force]``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # golden_state is imported as the tests import it

import elastic  # noqa: E402
import golden_state  # noqa: E402
from elastic.checkpoint.manifest import FORMAT_VERSION  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="overwrite this version's golden checkpoints")
    args = parser.parse_args()
    out = HERE / f"v{FORMAT_VERSION}"
    if out.exists():
        if not args.force:
            raise SystemExit(f"{out} exists; golden checkpoints are never rewritten (pass --force to do so)")
        shutil.rmtree(out)
    full = golden_state.build()
    plain = golden_state.build()
    plain.point = None
    plain.ratio = None
    for name, state in (("full", full), ("plain", plain)):
        path = elastic.save(state, out / name, keep=None)
        size = sum(f.stat().st_size for f in path.iterdir())
        sys.stdout.write(f"wrote {path.relative_to(HERE.parent.parent)} ({size} bytes)\n")


if __name__ == "__main__":
    main()
