"""Checkpoints written whole or not at all, and a resume that only starts from a whole one.

transformers' Trainer writes ``checkpoint-N`` file by file (weights, optimizer, scheduler, RNG
states, trainer_state.json last). A job killed or out of disk in between leaves a directory that
looks like the newest checkpoint and fails ``resume`` with a library error (``SafetensorError``,
``PytorchStreamReader failed``, ``JSONDecodeError``). Here:

- the trainer writes into ``<checkpoints>/.staging/checkpoint-N`` and ``publish`` renames it into
  place once every file is written (a rename within one file system is atomic);
- a save that fails removes its staging directory and, when the disk is full, says so with the
  path and the bytes free (``save_error``);
- ``newest_whole`` checks each checkpoint from the newest (``problem``: trainer_state.json parses,
  every safetensors header is sound and its data present, every torch pickle opens) and moves a
  damaged one aside as ``damaged-checkpoint-N`` (out of transformers' rotation), with a warning
  naming the bad file, so the resume starts from the previous whole one.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import struct
from pathlib import Path

from musique_rl.base import rundir

log = logging.getLogger(__name__)

STAGING = ".staging"
DAMAGED_PREFIX = "damaged-"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
_FULL_WORDS = ("no space left", "disk is full", "disk full", "quota exceeded")
# torch's C++ writer reports a failed write without the OS error: "basic_ios::clear: iostream
# error", "PytorchStreamWriter failed writing file"; with little space left that is a full disk
_WRITE_FAILED = ("iostream error", "failed writing file", "file write failed")
_LOW_SPACE = 64 * 2**20  # bytes: below this, a failed write is taken for a full disk


class DiskFullError(OSError):
    """A write failed because the disk (or quota) is full; the message names the path and bytes free."""

    def __init__(self, message: str):
        super().__init__(errno.ENOSPC, message)

    def __str__(self) -> str:
        return self.strerror


def free_bytes(path: str | Path) -> int:
    """Bytes free on the file system holding ``path`` (its nearest existing parent)."""
    p = Path(path).resolve()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def is_disk_full(exc: BaseException, path: str | Path) -> bool:
    """True when ``exc`` (or an exception it came from) is a full disk or quota."""
    seen = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(seen).lower()
        if any(w in text for w in _FULL_WORDS):
            return True
        if any(w in text for w in _WRITE_FAILED) and free_bytes(path) < _LOW_SPACE:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def disk_full_error(exc: BaseException, path: str | Path, what: str, then: str) -> DiskFullError:
    return DiskFullError(
        f"disk full: {what} at {path} failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
        f"{free_bytes(path)} bytes free there. {then}"
    )


def checkpoint_dirs(folder: str | Path) -> list[Path]:
    """``checkpoint-N`` directories of ``folder``, newest (largest N) first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _CHECKPOINT.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found, reverse=True)]


def publish(staged: Path, final: Path) -> None:
    """Move a fully written checkpoint into place; an older directory of the same name (a step saved
    again after a resume) is replaced."""
    old = staged.parent / f"replaced-{final.name}"
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(staged, final)
    shutil.rmtree(old, ignore_errors=True)


def save_error(exc: BaseException, staged: Path, final: Path) -> BaseException:
    """After a failed save: remove the partial files; the error to raise (a DiskFullError naming the
    path and bytes free when the disk is full, else ``exc``)."""
    shutil.rmtree(staged, ignore_errors=True)  # a partial checkpoint is never left to be resumed
    if not is_disk_full(exc, final.parent):
        return exc
    whole = checkpoint_dirs(final.parent)
    then = (f"The partial {final.name} was removed; free space (or move the run directory) and run the same command "
            f"again: it resumes from {whole[0].name if whole else 'the start (no checkpoint was complete)'} "
            "(train.resume=auto).")
    return disk_full_error(exc, final.parent, f"saving {final.name}", then)


def _safetensors_problem(path: Path) -> str | None:
    """The safetensors layout: 8-byte header length, JSON header, then the tensors' bytes, whose
    last offset must lie within the file (a cut file keeps a sound header)."""
    size = path.stat().st_size
    with path.open("rb") as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            return "shorter than a safetensors header"
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            return f"header length {n} exceeds the file ({size} bytes)"
        try:
            header = json.loads(fh.read(n))
        except ValueError as e:
            return f"header is not valid JSON ({e})"
    ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    if 8 + n + max(ends, default=0) > size:
        return f"cut short: {size} bytes, the header needs {8 + n + max(ends, default=0)}"
    return None


def problem(ckpt: str | Path) -> str | None:
    """Why ``ckpt`` cannot be resumed from (naming the file), or None when it is whole."""
    import torch

    ckpt = Path(ckpt)
    state = ckpt / rundir.TRAINER_STATE
    if not state.is_file():
        return f"{state} is missing (the save did not finish)"
    try:
        json.loads(state.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        return f"{state} is not valid JSON ({e})"
    weights = sorted(ckpt.glob("*.safetensors"))
    if not weights and not any(ckpt.glob("pytorch_model*.bin")) and not any(ckpt.glob("adapter_model.bin")):
        return f"{ckpt} holds no model weights"
    for f in weights:
        bad = _safetensors_problem(f)
        if bad:
            return f"{f}: {bad}"
    for f in sorted([*ckpt.glob("*.pt"), *ckpt.glob("*.pth")]):
        try:  # mmap: the tensors stay on disk, only the archive's index and the pickle are read
            torch.load(f, map_location="cpu", mmap=True, weights_only=False)
        except Exception as e:
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            return f"{f} cannot be loaded ({first})"
    return None


def newest_whole(folder: str | Path) -> str | None:
    """The newest checkpoint of ``folder`` that ``problem`` finds whole; damaged newer ones are moved
    aside (``damaged-checkpoint-N``) with a warning naming the bad file. None when there is none."""
    for ckpt in checkpoint_dirs(folder):
        bad = problem(ckpt)
        if bad is None:
            return str(ckpt)
        aside = ckpt.with_name(DAMAGED_PREFIX + ckpt.name)
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(ckpt, aside)
        log.warning("checkpoint %s is damaged: %s. Moved aside to %s; resuming from the previous whole checkpoint",
                    ckpt, bad, aside.name)
    return None
