"""Write (or --check) docs/inputs.md's table of supported architectures from the test matrix (tests/arch_matrix.py).

The table's rows are the matrix's: each supported row is a tiny model that tests/target/test_model_architectures.py
decodes exactly, each family row one that tests/target/test_families.py trains with every kind and decodes plainly
(speculative decoding refused, the refusal's reason shortened); the engine columns come from eaglekit.export.engines. ``python scripts/arch_table.py`` rewrites the block between its two markers in
docs/inputs.md; ``--check`` exits 1 if its block differs.
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from arch_matrix import TABLE_BEGIN, TABLE_END, readme_block

from eaglekit.fileio import write_text


def updated(readme: str) -> str:
    """``readme`` with its table block replaced by the matrix's (refused if the markers are missing)."""
    start, end = readme.find(TABLE_BEGIN), readme.find(TABLE_END)
    if start < 0 or end < start:
        raise SystemExit(f"docs/inputs.md: no architectures table markers ({TABLE_BEGIN!r} ... {TABLE_END!r})")
    return readme[:start] + readme_block() + readme[end + len(TABLE_END):]


def main(argv: list[str]) -> int:
    path = ROOT / "docs" / "inputs.md"
    readme = path.read_text()
    new = updated(readme)
    if "--check" in argv:
        if new != readme:
            print("docs/inputs.md: the architectures table differs from the matrix; run python scripts/arch_table.py")
            return 1
        return 0
    if new != readme:
        write_text(path, new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
