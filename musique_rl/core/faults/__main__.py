"""``python -m musique_rl.core.faults``: the planted faults' table, from their declarations.

    python -m musique_rl.core.faults                                 # print it (markdown)
    python -m musique_rl.core.faults --write docs/architecture.md    # rewrite that document's section
"""

from __future__ import annotations

import argparse
from pathlib import Path

from musique_rl.core.faults import table
from musique_rl.core.faults._docs import write_section

KEY = "faults"  # the section's markers: <!-- faults:start --> ... <!-- faults:end -->
COMMAND = "python -m musique_rl.core.faults --write docs/architecture.md"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write", type=Path, help=f"a markdown file whose <!-- {KEY}:start/end --> section becomes the table")
    args = ap.parse_args(argv)
    if args.write is None:
        print(table())
    else:
        write_section(args.write, KEY, table(), COMMAND)
        print(f"wrote the faults table into {args.write}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
