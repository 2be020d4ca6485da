"""Writing a verdict: its plots, verdict.json and status.md (sweep dir), MLflow; and publishing it.

A sweep's callback (musique_rl/sweep/callback.py) and ``python -m musique_rl.verdict`` call three
steps, in this order: ``draw_plots`` (the rows link the plots), ``write`` (the files), ``attach``
(the MLflow parent run). They write into the sweep directory and MLflow only: a user's sweep never
edits the repository.

The repository's status file docs/STATUS.md (``sweep.STATUS``; README.md links it) and its plots
under docs/verdicts/<id>/ change only through ``publish_status`` (``python -m musique_rl.verdict
publish --sweep DIR``, ``make publish SWEEP_DIR=DIR``), which refuses, unless forced, a verdict that
``publish_problems`` names: runs too short for the hypothesis or inside the warm-up, an unknown
budget, a dirty or unknown commit, runs on more than one machine type, a failed or missing job.
``row_problems`` reads the same from a published row, so a check of the page
(``python -m musique_rl.verdict check``, tests/test_docs.py) fails when a row drifts back.

The status table lists every hypothesis in conf/hypothesis/ ("Not run" until judged) between
``<!-- verdicts:start -->`` and ``<!-- verdicts:end -->``: in the sweep dir's status.md, and in the
status file, where publishing rewrites its own row and keeps the others. Each row's notes open with
the budget (steps x seeds) and carry what the figure depends on besides the config: the warm-start
hash, the machine and the commit, so a row read on another machine says where it was measured.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

from musique_rl.base import rundir
from musique_rl.verdict import budget as _budget
from musique_rl.verdict.load import load_hypothesis_file
from musique_rl.verdict.sweep import HYPOTHESIS_DIR, STATUS, UNKNOWN, VerdictError

log = logging.getLogger(__name__)

MARK_START, MARK_END = "<!-- verdicts:start -->", "<!-- verdicts:end -->"
COLUMNS = ("hypothesis", "priority", "status", "confidence", "notes")


# ---------------------------------------------------------------- words
def summary_line(v: dict[str, Any]) -> str:
    h = v["hypothesis"]
    b = v.get("budget")
    parts = [_budget.words(b)]
    if b and b.get("too_short"):
        parts.append("too short to judge (" + b["too_short"] + ")")
    if v["ci"] is not None:
        parts.append(f"effect {v['effect']:+.4f} [{v['ci_level']:.0%} t-interval {v['ci'][0]:+.4f}, {v['ci'][1]:+.4f}] "
                     f"on {h['metric']}")
    elif v["effect"] is not None:
        parts.append(f"effect {v['effect']:+.4f} on {h['metric']} (one pair)")
    parts.append(f"predicted {h['direction']} by > {h['min_effect']}")
    parts.append(f"{v['n_pairs']}/{v['n_seeds']} seed pairs")
    if v.get("seeds_in_predicted_direction") is not None:
        parts.append(f"{v['seeds_in_predicted_direction']}/{v['n_pairs']} in the predicted direction")
    if v.get("sign_flip_p") is not None:
        parts.append(f"sign-flip p {v['sign_flip_p']:.3g}")
    return "; ".join(parts)


def machine_words(machine: str) -> str:
    """"AMD EPYC 7B13 | 1 threads | cpu" -> "AMD EPYC 7B13 x1 thread, cpu" (other text unchanged)."""
    parts = machine.split(" | ")
    if len(parts) != 3 or not parts[1].endswith(" threads"):
        return machine
    threads = parts[1].removesuffix(" threads")
    return f"{parts[0]} x{threads} thread{'' if threads == '1' else 's'}, {parts[2]}"


def provenance_line(v: dict[str, Any]) -> str:
    """"warm start 3f2a9c1b0d4e; AMD EPYC 7B13 x1 thread, cpu; commit 25917a6" (lists when several)."""
    warm = v.get("warm_start") or [UNKNOWN]
    machines = v.get("machine") or [UNKNOWN]
    shas = v.get("commits") or [UNKNOWN]
    return "; ".join([
        ("warm start " if len(warm) == 1 else "warm starts ") + ", ".join(warm),
        (UNKNOWN + " machine" if machines == [UNKNOWN] else " + ".join(machine_words(m) for m in machines)),
        ("commit " if len(shas) == 1 else "commits ") + ", ".join(shas),
    ])


def table_row(v: dict[str, Any]) -> dict[str, str]:
    h = v["hypothesis"]
    where = v["source"].get("sweep_dir") or v["source"].get("sweep_id") or ""
    notes = summary_line(v)
    if v.get("confounds"):
        notes = "CONFOUNDED: " + "; ".join(v["confounds"]) + "; " + notes
    if v["missing"]:
        notes += "; missing " + ", ".join(f"{m['arm']}/seed {m['seed']} ({m['status']})" for m in v["missing"])
    notes += "; " + provenance_line(v)
    notes += f"; {where} {v['generated_at'][:10]}".rstrip()
    if v.get("plots"):
        notes += "; plots: " + ", ".join(f"[{Path(p).stem.replace('_', ' ')}]({p})" for p in v["plots"].values())
    return {
        "hypothesis": f"{h['id']} {h['title']}".strip(),
        "priority": h["priority"],
        "status": v["status"],
        "confidence": "" if v["confidence"] is None else f"{v['confidence']:.2f}",
        "notes": notes,
    }


def report(verdict: dict[str, Any]) -> str:
    """The verdict for a terminal: status line, summary, each pair, the notes."""
    h = verdict["hypothesis"]
    conf = "" if verdict["confidence"] is None else f" (confidence {verdict['confidence']:.2f})"
    short = ", too short to judge" if (verdict.get("budget") or {}).get("too_short") else ""
    lines = [f"{h['id']} {h['title']}: {verdict['status']}{conf}{short} [{_budget.words(verdict.get('budget'))}]",
             "  " + summary_line(verdict),
             "  " + provenance_line(verdict)]
    for p in verdict["pairs"]:
        lines.append(f"  seed {p['seed']}: control {p['control']:.4f}  treatment {p['treatment']:.4f}  diff {p['diff']:+.4f}")
    lines += [f"  note: {n}" for n in verdict["notes"]]
    return "\n".join(lines)


# ---------------------------------------------------------------- the status table
def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _split_row(line: str) -> list[str]:
    cells = re.split(r"(?<!\\)\|", line.strip().strip("|"))
    return [c.strip().replace("\\|", "|") for c in cells]


def render_table(rows: dict[str, dict[str, str]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for hid in sorted(rows):
        lines.append("| " + " | ".join(_cell(rows[hid][c]) for c in COLUMNS) + " |")
    return "\n".join(lines)


def _all_hypotheses() -> dict[str, dict[str, str]]:
    """A "not run" row for every hypothesis in conf/hypothesis/, so the table lists them all."""
    rows = {}
    for path in sorted(HYPOTHESIS_DIR.glob("h*.yaml")):
        try:
            h = load_hypothesis_file(path.stem)
        except VerdictError:
            continue
        rows[h.id] = {"hypothesis": f"{h.id} {h.title}".strip(), "priority": h.priority,
                      "status": "Not run", "confidence": "", "notes": ""}
    return rows


def _existing_rows(text: str) -> dict[str, dict[str, str]]:
    """Rows of the previously generated table (this module wrote them; format known)."""
    rows = {}
    if MARK_START not in text or MARK_END not in text:
        return rows
    block = text.split(MARK_START, 1)[1].split(MARK_END, 1)[0]
    for line in block.splitlines():
        cells = _split_row(line) if line.startswith("|") else []
        # rows only: the header's first cell is "hypothesis", a row's starts with an id (h01 ...)
        if len(cells) == len(COLUMNS) and re.fullmatch(r"h\d+", cells[0].split()[0] if cells[0] else ""):
            rows[cells[0].split()[0]] = dict(zip(COLUMNS, cells, strict=True))
    return rows


def status_table(verdict: dict[str, Any], status_text: str = "") -> str:
    """Every hypothesis' row: this verdict's, the others as ``status_text``'s table has them."""
    rows = _all_hypotheses()
    rows.update(_existing_rows(status_text))
    rows[verdict["hypothesis"]["id"]] = table_row(verdict)
    return render_table(rows)


def update_status_file(table: str, status_file: Path = STATUS) -> None:
    """Replace only what lies between the markers; append the markers at the end if absent."""
    text = status_file.read_text() if status_file.exists() else ""
    block = (f"{MARK_START}\n<!-- generated by `python -m musique_rl.verdict publish`; do not edit by hand -->\n"
             f"{table}\n{MARK_END}")
    if MARK_START in text and MARK_END in text:
        head, rest = text.split(MARK_START, 1)
        tail = rest.split(MARK_END, 1)[1]
        text = head + block + tail
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + block + "\n"
    status_file.write_text(text)


# ---------------------------------------------------------------- the steps (sweep dir and MLflow only)
def draw_plots(verdict: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    """The sweep's plots in ``out_dir/plots``; sets ``verdict["plots"]`` (name -> path) for the row."""
    from musique_rl.verdict import plots as sweep_plots

    try:
        drawn = sweep_plots.draw(verdict, out_dir)
    except Exception as exc:  # a plotting problem must not lose the verdict
        log.warning("could not draw the sweep's plots: %s", exc)
        return {}
    verdict["plots"] = {name: str(p) for name, p in drawn.items()}
    return drawn


def write(verdict: dict[str, Any], out_dir: Path) -> dict[str, str]:
    """verdict.json and status.md (this verdict's row among "Not run" ones) in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    table = status_table(verdict)
    (out_dir / rundir.VERDICT).write_text(json.dumps({**verdict, "status_table": table}, indent=2) + "\n")
    (out_dir / rundir.STATUS).write_text(table + "\n")
    return {rundir.VERDICT: str(out_dir / rundir.VERDICT), rundir.STATUS: str(out_dir / rundir.STATUS)}


def attach(verdict: dict[str, Any], written: dict[str, str], plots: dict[str, Path], tracking_uri: str | None,
           parent_run_id: str) -> bool:
    """verdict.json, status.md and the plots as artifacts of the sweep's parent run, and its
    ``verdict`` tag. False (said) when the store fails: the files are written, a tracking hiccup
    must not lose them."""
    try:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=tracking_uri)
        client.log_artifact(parent_run_id, written[rundir.VERDICT])
        client.log_artifact(parent_run_id, written[rundir.STATUS])
        for p in plots.values():
            client.log_artifact(parent_run_id, str(p), "plots")
        client.set_tag(parent_run_id, "verdict", verdict["status"])
        return True
    except Exception as exc:
        log.warning("could not attach the verdict to MLflow run %s: %s", parent_run_id, exc)
        return False


def publish(verdict: dict[str, Any], *, out: Path | None = None) -> dict[str, str]:
    """All three steps for a verdict judged again (``python -m musique_rl.verdict``): plots, files
    (the sweep dir, or ``out``), and the parent run the verdict's runs name (MLflow source)."""
    src = verdict["source"]
    out_dir = out if out is not None else Path(src["sweep_dir"]) if src.get("sweep_dir") else Path.cwd()
    plots = draw_plots(verdict, out_dir)
    written = {f"plots/{name}": str(p) for name, p in plots.items()}
    written.update(write(verdict, out_dir))
    parent = src.get("parent_run_id")
    if parent and attach(verdict, written, plots, src.get("tracking_uri"), parent):
        written["mlflow_parent_run"] = parent
    return written


# ---------------------------------------------------------------- publishing (the status file)
class PublishRefused(VerdictError):
    """A verdict the status file must not carry (``publish_problems``), said with each reason."""


def publish_problems(verdict: dict[str, Any]) -> list[str]:
    """Why this verdict may not be published, one sentence each (empty: it may)."""
    problems = []
    b = verdict.get("budget") or {}
    if b.get("too_short"):
        problems.append(f"too short to judge: {b['too_short']}")
    if b.get("steps") is None:
        problems.append("the runs' length is unknown (their config records no train.max_steps)")
    commits = verdict.get("commits") or []
    dirty = [c for c in commits if c.endswith("+dirty")]
    if dirty:
        problems.append(f"runs from a dirty tree ({', '.join(dirty)}): commit the code and run the sweep again")
    elif not commits:
        problems.append("the runs record no commit (tracking was off): nothing shows they ran one clean tree")
    machines = verdict.get("machine") or []
    if len(machines) > 1:
        problems.append(f"the runs mix {len(machines)} machine types ({' + '.join(machines)}): run the sweep on one")
    elif machines in ([], [UNKNOWN]):
        problems.append("the runs record no machine")
    if verdict.get("missing"):
        problems.append("failed or missing jobs: " + ", ".join(f"{m['arm']}/seed {m['seed']} ({m['status']})"
                                                             for m in verdict["missing"]))
    return problems


def row_problems(row: dict[str, str]) -> list[str]:
    """``publish_problems`` read back from a published row of the status table (its notes are
    ``table_row``'s words): a dirty tree, several machines, a failed job, no budget, too short."""
    if row.get("status") == "Not run":
        return []
    notes = row.get("notes", "")
    parts = notes.split("; ")
    problems = []
    if not re.match(r"(\d+(-\d+)?|steps unknown) steps? x \d+ seeds?\b", parts[0] if parts else ""):
        problems.append("states no budget (steps x seeds)")
    if "too short to judge" in notes:
        problems.append("too short to judge")
    if re.search(r"\bcommits? [^;]*\+dirty", notes):
        problems.append("from a dirty tree (+dirty)")
    warm = next((i for i, p in enumerate(parts) if p.startswith(("warm start ", "warm starts "))), None)
    if warm is not None and warm + 1 < len(parts) and " + " in parts[warm + 1]:
        problems.append("mixes machine types (" + parts[warm + 1] + ")")
    failed = re.findall(r"(\w+/seed \d+) \((FAILED|KILLED|MISSING)\)", notes)
    if failed:
        problems.append("carries failed jobs (" + ", ".join(f"{c} {s}" for c, s in failed) + ")")
    return problems


def status_file_problems(status_file: Path = STATUS) -> dict[str, list[str]]:
    """Each published row's ``row_problems`` (hypothesis id -> problems; only rows that have any)."""
    rows = _existing_rows(status_file.read_text())
    return {hid: probs for hid, row in sorted(rows.items()) if (probs := row_problems(row))}


def publish_status(verdict: dict[str, Any], status_file: Path = STATUS, *, force: bool = False) -> dict[str, str]:
    """Copy the verdict's plots beside ``status_file`` (verdicts/<id>/, which its row links) and
    rewrite its row there, keeping the others. Refused (``PublishRefused``, every reason named)
    when ``publish_problems`` finds any, unless ``force``."""
    import shutil

    problems = publish_problems(verdict)
    if problems and not force:
        raise PublishRefused(f"not published to {status_file} ({verdict['hypothesis']['id']}):\n  - "
                             + "\n  - ".join(problems) + "\n(--force publishes it anyway; the row then says what is wrong "
                             "with it and `python -m musique_rl.verdict check` fails)")
    links = {}
    for name, p in (verdict.get("plots") or {}).items():
        dest = status_file.parent / "verdicts" / verdict["hypothesis"]["id"] / Path(p).name
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(p, dest)
        links[name] = dest.relative_to(status_file.parent).as_posix()
    row = {**verdict, "plots": links}
    text = status_file.read_text() if status_file.exists() else ""
    update_status_file(status_table(row, text), status_file)
    written = {"status_file": str(status_file)}
    written.update({f"plots/{name}": str(status_file.parent / link) for name, link in links.items()})
    if problems:
        written["forced_over"] = "; ".join(problems)
    return written
