"""Records in the MuSiQue schema: dataset specs, validation, filters.

A spec is one or more ``path,name,split`` strings joined by ';' (the original researcher's syntax), with HF split
slicing (``bdsaglam/musique,answerable,train[:256]``). Each part is one of
- a hub dataset, loaded with ``datasets.load_dataset(path, name, split=split)``;
- a local file in the original MuSiQue format (jsonl, or a json list): the part is its path,
  optionally followed by ``,name,split[slice]`` to slice it (the name is ignored); a relative path
  is read from ``env.data_dir`` when it is set (the one option for data outside this repository,
  default ``$MUSIQUE_RL_DATA``), else from the working directory;
- ``<generator>,<name>,<split>``: a task's embedded generator (``Task.generator``,
  musique_rl/env/tasks/): ``synthetic`` (musique_rl/env/synthetic.py, ``env.synthetic`` sizes) or
  ``arith`` (musique_rl/env/arith_records.py, ``env.arith`` settings; records without paragraphs, valid
  under ``env.task=arith``); split ``train`` gives ``num_train`` records, any other ``num_eval``.
All parts are concatenated, validated, filtered (env.answerable_only, env.hops, env.noise_rate,
env.max_paragraphs) and shuffled with the seed. ``load_records`` is the entry point.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Any

from musique_rl.env.config import EnvConfig
from musique_rl.env.tasks import TASKS, generators, task_for

log = logging.getLogger(__name__)

LOCAL_SUFFIXES = (".jsonl", ".json")


class InvalidRecordError(ValueError):
    """A record that does not follow the MuSiQue schema; the message names the record and field."""


# ---------------------------------------------------------------- spec parsing
def parse_spec(spec: str) -> list[dict]:
    """Split a spec string into parts: ``[{"kind": hub|local|<generator>, "path", "name", "split"}]``
    (a generator is a task's embedded one: synthetic, arith, ...)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"env.data={spec!r}: expected 'path,name,split' specs joined by ';' or a file path")
    parts = []
    for raw in spec.split(";"):
        raw = raw.strip()
        if not raw:
            continue
        fields = [f.strip() for f in raw.split(",")]
        path = fields[0]
        if path in generators():
            if len(fields) != 3:
                raise ValueError(f"env.data part {raw!r}: expected '{path},<name>,<split>'")
            parts.append({"kind": path, "path": path, "name": fields[1], "split": fields[2]})
        elif path.endswith(LOCAL_SUFFIXES) or Path(path).is_file():
            if len(fields) not in (1, 3):
                raise ValueError(f"env.data part {raw!r}: expected '<file>' or '<file>,<name>,<split[slice]>'")
            parts.append({"kind": "local", "path": path, "name": None, "split": fields[2] if len(fields) == 3 else None})
        else:
            if len(fields) != 3:
                raise ValueError(
                    f"env.data part {raw!r}: expected 'path,name,split' (e.g. bdsaglam/musique,answerable,train[:256]) "
                    "or the path of a local .jsonl/.json file"
                )
            parts.append({"kind": "hub", "path": path, "name": fields[1] or None, "split": fields[2]})
    if not parts:
        raise ValueError(f"env.data={spec!r}: no dataset spec in it")
    return parts


def _slice(records: list[dict], split: str | None) -> list[dict]:
    """Apply HF split slicing (``train[:256]``, ``train[10:20]``, ``train[:10%]``) to a list."""
    if not split or "[" not in split:
        return records
    import datasets

    name = split.split("[", 1)[0]
    try:
        (instr,) = datasets.ReadInstruction.from_spec(split).to_absolute({name: len(records)})
    except (ValueError, AssertionError) as e:
        raise ValueError(f"env.data split {split!r}: not a valid split slice ({e})") from e
    return records[instr.from_ : instr.to]


# ---------------------------------------------------------------- loading
FETCH = "python -m musique_rl.data fetch --out DIR"  # MuSiQue-Ans as the local files env=musique reads


def local_path(path: str, data_dir: str | None) -> Path:
    """A local file of ``env.data`` / ``env.eval_data`` / ``env.corpus``: absolute (or ``~``) as given,
    relative under ``data_dir`` when set, else under the working directory."""
    p = Path(path).expanduser()
    return p if p.is_absolute() or not data_dir else Path(data_dir).expanduser() / p


def missing_file(key: str, path: Path, data_dir: str | None) -> str:
    """What to say about a local file that is not there: where it was looked for, and how to get it."""
    where = (f"env.data_dir={data_dir}" if data_dir else
             "the working directory (env.data_dir is unset: set it, or MUSIQUE_RL_DATA, to the folder of data "
             "outside this repository)")
    return (f"{key}: local file {str(path)!r} does not exist (relative paths are read from {where}). "
            f"MuSiQue-Ans as local files: {FETCH}, then env.data_dir=DIR")


def _read_local(path: str, skip_invalid: bool = False, counts: dict | None = None,
                data_dir: str | None = None) -> list[dict]:
    """A local .json list or .jsonl file, as plain records.

    Why not ``datasets.load_dataset("json", data_files=...)``: it infers one Arrow schema over all
    records: a field whose type differs between records fails with an Arrow error about a column, not
    a record id, and a field missing from some records is filled with None in them; here each record
    reaches ``validate`` as written, which names the record id and field, and a bad line is named. The split slice still uses
    the datasets library's own parser (``_slice``). With ``skip_invalid`` a line that is not JSON is
    skipped like an invalid record, and counted in ``counts["invalid"]``."""
    p = local_path(path, data_dir)
    if not p.is_file():
        raise FileNotFoundError(missing_file("env.data", p, data_dir))
    text = p.read_text(encoding="utf-8")
    if p.suffix == ".json" or text.lstrip().startswith("["):
        data = json.loads(text)
        if not isinstance(data, list):
            raise ValueError(f"env.data: {p} holds a JSON {type(data).__name__}, expected a list of MuSiQue records")
        return data
    records = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                if not skip_invalid:
                    raise ValueError(f"env.data: {p} line {lineno} is not valid JSON ({e})\n"
                                     "(set env.skip_invalid=true to skip and count invalid records)") from e
                if counts is not None:
                    counts["invalid"] = counts.get("invalid", 0) + 1
                log.warning("env.data: skipping %s line %d: not valid JSON (%s)", p, lineno, e)
    return records


def _read_hub(path: str, name: str | None, split: str) -> list[dict]:
    import datasets

    try:
        ds = datasets.load_dataset(path, name, split=split)
    except Exception as e:  # offline, unknown repo, bad config: all need the same advice
        raise RuntimeError(
            f"env.data: could not load the hub dataset {path!r} (name={name!r}, split={split!r}): "
            f"{type(e).__name__}: {e}\nOffline or without hub access? Fetch MuSiQue-Ans once where the hub is "
            f"reachable ({FETCH}) and read the files with env=musique env.data_dir=DIR; any local file in the MuSiQue "
            "format works too (env.data=/path/file.jsonl), or the embedded data: env.data=synthetic,default,train"
        ) from e
    return [dict(r) for r in ds]


def _read_generator(part: dict, env_cfg: EnvConfig, seed: int) -> list[dict]:
    """Records of a task's embedded generator (``Task.generate``), then the split's slice."""
    base = part["split"].split("[", 1)[0]
    return _slice(generators()[part["kind"]].generate(base, env_cfg, seed), part["split"])


# ---------------------------------------------------------------- validation
_FIELDS = {
    "id": str,
    "question": str,
    "answer": str,
    "answer_aliases": list,
    "answerable": bool,
    "paragraphs": list,
    "question_decomposition": list,
}
_PARAGRAPH_FIELDS = {"idx": int, "title": str, "paragraph_text": str, "is_supporting": bool}
_STEP_FIELDS = {"question": str, "answer": str}


def _type_name(t: type) -> str:
    return {str: "a string", bool: "a boolean", int: "an integer", list: "a list"}[t]


def validate_record(rec: Any, where: str = "", documents: bool = True) -> None:
    """Raise InvalidRecordError naming the record id and the field if ``rec`` breaks the schema.

    ``documents=False`` (a task whose records hold no documents, ``Task.documents``: arith):
    ``paragraphs`` may be empty, and a decomposition step then needs no ``paragraph_support_idx``."""
    rid = rec.get("id", "<no id>") if isinstance(rec, dict) else "<not an object>"
    at = f" ({where})" if where else ""

    def bad(field: str, why: str) -> InvalidRecordError:
        return InvalidRecordError(f"record {rid!r}{at}: field '{field}' {why}")

    if not isinstance(rec, dict):
        raise InvalidRecordError(f"record {where or ''} is a {type(rec).__name__}, expected a JSON object")
    for key, typ in _FIELDS.items():
        if key not in rec or rec[key] is None:
            raise bad(key, "is missing")
        if not isinstance(rec[key], typ):
            raise bad(key, f"must be {_type_name(typ)}, got {type(rec[key]).__name__}")
    if not rec["paragraphs"] and documents:
        without = " or ".join(f"env.task={t.name}" for t in TASKS.values() if not t.documents) or "no task"
        raise bad("paragraphs", f"is empty (a record without documents is valid only under {without})")
    seen = set()
    for i, p in enumerate(rec["paragraphs"]):
        if not isinstance(p, dict):
            raise bad(f"paragraphs[{i}]", "must be an object")
        for key, typ in _PARAGRAPH_FIELDS.items():
            if key not in p or not isinstance(p[key], typ) or (typ is int and isinstance(p[key], bool)):
                raise bad(f"paragraphs[{i}].{key}", f"must be {_type_name(typ)}")
        if p["idx"] in seen:
            raise bad(f"paragraphs[{i}].idx", f"repeats idx {p['idx']}")
        seen.add(p["idx"])
    if not rec["question_decomposition"]:
        raise bad("question_decomposition", "is empty")
    for i, step in enumerate(rec["question_decomposition"]):
        if not isinstance(step, dict):
            raise bad(f"question_decomposition[{i}]", "must be an object")
        for key, typ in _STEP_FIELDS.items():
            if not isinstance(step.get(key), typ):
                raise bad(f"question_decomposition[{i}].{key}", f"must be {_type_name(typ)}")
        sup = step.get("paragraph_support_idx")
        if sup is None and (not rec["answerable"] or not seen):
            continue  # MuSiQue's unanswerable records may lack support for a hop; a no-document task has none
        if isinstance(sup, bool) or not isinstance(sup, int) or sup not in seen:
            raise bad(
                f"question_decomposition[{i}].paragraph_support_idx",
                f"is {sup!r}, which is not the idx of any paragraph (paragraph idx: {sorted(seen)})",
            )


# ---------------------------------------------------------------- filters
def hop_count(rec: dict) -> int:
    return len(rec["question_decomposition"])


def _subsample_paragraphs(rec: dict, env_cfg: EnvConfig, seed: int) -> dict:
    """Apply noise_rate and max_paragraphs; supporting paragraphs always stay, idx never changes."""
    noise = env_cfg.noise_rate
    cap = env_cfg.max_paragraphs
    if noise >= 1.0 and cap is None:
        return rec
    # Seeded per record (not per position) so a record keeps the same paragraphs in any order/mix.
    rng = random.Random(f"{seed}:{rec['id']}")
    kept = [p for p in rec["paragraphs"] if p["is_supporting"] or rng.random() < noise]
    if cap is not None:
        n_support = sum(p["is_supporting"] for p in kept)
        room = max(int(cap) - n_support, 0)
        distractors = [i for i, p in enumerate(kept) if not p["is_supporting"]][:room]
        keep_idx = set(distractors)
        kept = [p for i, p in enumerate(kept) if p["is_supporting"] or i in keep_idx]
    return {**rec, "paragraphs": kept}


def load_records(spec: str, env_cfg: EnvConfig, seed: int, stats: dict | None = None) -> list[dict]:
    """Load, validate, filter and shuffle the records of ``spec`` (module docstring).

    ``stats``, when given, is filled with counts: loaded, invalid, unanswerable, wrong_hops, kept.
    """
    raw: list[tuple[dict, str]] = []
    malformed = {"invalid": 0}  # lines of local files that are not JSON (skipped under env.skip_invalid)
    for part in parse_spec(spec):
        if part["kind"] == "local":
            recs = _slice(_read_local(part["path"], env_cfg.skip_invalid, malformed, env_cfg.data_dir), part["split"])
            where = part["path"]
        elif part["kind"] == "hub":
            recs = _read_hub(part["path"], part["name"], part["split"])
            where = f"{part['path']},{part['name']},{part['split']}"
        else:
            recs = _read_generator(part, env_cfg, seed)
            where = f"{part['kind']},{part['name']},{part['split']}"
        raw += [(r, f"{where} #{i}") for i, r in enumerate(recs)]

    counts = {"loaded": len(raw) + malformed["invalid"], "invalid": malformed["invalid"], "unanswerable": 0,
              "wrong_hops": 0, "kept": 0}
    hops = set(env_cfg.hops) if env_cfg.hops else None
    documents = task_for(env_cfg).documents
    records = []
    for rec, where in raw:
        try:
            validate_record(rec, where, documents=documents)
        except InvalidRecordError as e:
            if not env_cfg.skip_invalid:
                raise InvalidRecordError(f"{e}\n(set env.skip_invalid=true to skip and count invalid records)") from None
            counts["invalid"] += 1
            log.debug("skipping invalid record: %s", e)
            continue
        if env_cfg.answerable_only and not rec["answerable"]:
            counts["unanswerable"] += 1
            continue
        if hops is not None and hop_count(rec) not in hops:
            counts["wrong_hops"] += 1
            continue
        records.append(_subsample_paragraphs(rec, env_cfg, seed))
    if counts["invalid"]:
        log.warning("env.data: skipped %d invalid record(s) of %d (env.skip_invalid=true)", counts["invalid"], counts["loaded"])
    random.Random(seed).shuffle(records)
    counts["kept"] = len(records)
    if not records:
        raise ValueError(f"env.data={spec!r}: no record left after filtering ({counts})")
    log.info("env.data: %s", counts)
    if stats is not None:
        stats.update(counts)
    return records
