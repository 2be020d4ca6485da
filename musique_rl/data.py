"""``python -m musique_rl.data fetch --out DIR``: MuSiQue-Ans as the local files ``env=musique`` reads.

    python -m musique_rl.data fetch --out ~/data/musique            # train and validation, ~1-2 min
    python -m musique_rl env=musique env.data_dir=~/data/musique      # or: export MUSIQUE_RL_DATA=~/data/musique

Reads MuSiQue-Ans (Trivedi et al., TACL 2022, CC BY 4.0; the answerable subset of MuSiQue, in its
original schema) from the Hugging Face Hub through ``datasets`` (``--source``: ``bdsaglam/musique``,
config ``answerable``, the hub copy the original researcher read), checks every record against the
MuSiQue schema (``env.data.validate_record``: a bad one is named by id and field), and writes
``musique_ans_train.jsonl`` and ``musique_ans_validation.jsonl`` into ``--out``, the folder
``env.data_dir`` then points at (compute nodes without internet read the files). Offline, it says
so and how to go on. ``--source`` may also be a local dataset folder (what tests use).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SOURCE, CONFIG = "bdsaglam/musique", "answerable"
FILES = {"train": "musique_ans_train.jsonl", "validation": "musique_ans_validation.jsonl"}  # env=musique's names


class FetchError(RuntimeError):
    """The dataset could not be read (offline, unknown source) or holds a record that is not MuSiQue."""


def fetch(out: Path, source: str = SOURCE, config: str = CONFIG, splits: tuple[str, ...] = tuple(FILES)) -> dict[str, int]:
    """Each split of ``source`` as ``out/<FILES[split]>`` (validated, written whole or not at all);
    returns records per split."""
    import datasets

    from musique_rl.env.data import InvalidRecordError, validate_record

    out.mkdir(parents=True, exist_ok=True)
    counts = {}
    for split in splits:
        try:
            ds = datasets.load_dataset(source, config, split=split)
        except Exception as exc:  # offline, unknown repo, no such split: the same advice for each
            first = (str(exc).strip().splitlines() or [""])[0][:300]
            raise FetchError(
                f"could not read {source!r} (config {config!r}, split {split!r}) through datasets: "
                f"{type(exc).__name__}: {first}\nOffline, or the Hugging Face Hub unreachable from here? Run this "
                f"where it is reachable and copy {out} here; or, with the dataset already in the hub cache, set "
                "HF_DATASETS_OFFLINE=1. Any file in the MuSiQue format works too: env.data=/path/file.jsonl") from exc
        path = out / FILES[split]
        tmp = path.with_suffix(".jsonl.partial")
        with open(tmp, "w", encoding="utf-8") as fh:
            for i, rec in enumerate(ds):
                try:
                    validate_record(rec, f"{source} {split} #{i}")
                except InvalidRecordError as exc:
                    tmp.unlink()
                    raise FetchError(f"{source} is not MuSiQue-schema data: {exc}") from exc
                fh.write(json.dumps(dict(rec), ensure_ascii=False) + "\n")
        tmp.replace(path)
        counts[split] = len(ds)
    return counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m musique_rl.data", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fetch", help="MuSiQue-Ans train and validation as local jsonl files")
    f.add_argument("--out", type=Path, required=True, help="the folder env.data_dir (or MUSIQUE_RL_DATA) will name")
    f.add_argument("--source", default=SOURCE, help=f"hub dataset id or local dataset folder (default {SOURCE})")
    f.add_argument("--config", default=CONFIG, help=f"dataset config (default {CONFIG})")
    a = ap.parse_args(argv)
    try:
        counts = fetch(a.out.expanduser(), a.source, a.config)
    except FetchError as exc:
        print(f"musique_rl.data fetch: {exc}", file=sys.stderr)
        return 1
    for split, n in counts.items():
        print(f"{a.out / FILES[split]}: {n} records ({split})")
    print(f"next: python -m musique_rl env=musique env.data_dir={a.out}   (or export MUSIQUE_RL_DATA={a.out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
