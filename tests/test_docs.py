"""The docs a newcomer reads: links that lead somewhere, a README of a few screens that names the
commands CI and the status file rely on, and measurement records written by their commands."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "launchers" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# [text](target) with the target up to a space, ')' or '#'; images too. Code spans are removed first.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s#]+)(?:#[^)]*)?\)")
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)


def _links(path: Path) -> list[str]:
    return [t for t in LINK.findall(CODE.sub("", path.read_text())) if not re.match(r"[a-z]+:", t)]


def test_every_relative_link_in_the_readme_and_docs_resolves_to_a_file():
    broken = [f"{p.relative_to(ROOT)} -> {t}" for p in DOCS for t in _links(p) if not (p.parent / t).exists()]
    assert not broken, "links to nothing:\n" + "\n".join(broken)
    assert _links(ROOT / "README.md"), "the README links to no page (the link pattern found nothing)"


def test_the_link_check_finds_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("[ok](page.md) [gone](missing.md#part) `[code](nowhere.md)` [web](https://example.org)\n")
    assert [t for t in _links(page) if not (tmp_path / t).exists()] == ["missing.md"]


def test_the_readme_fits_on_a_few_screens_and_names_the_commands_users_and_ci_run():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150, "the README grows back into a lab notebook: move detail to docs/howto"
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci and "make test" in text, "CI runs the README's test command: keep it in both"
    for command in ("make setup", "make train", "+hypothesis=h01", "make sweep", "musique_rl.doctor --run-dir",
                    "make gpu-smoke", "musique_rl.gpu_job", "docs/STATUS.md", "make publish", "make setup-gpu",
                    "musique_rl.data fetch", "MUSIQUE_RL_DATA", "hydra/launcher=slurm", "env=musique"):
        assert command in text, command


def test_the_status_file_holds_the_verdict_table_between_its_markers():
    text = (ROOT / "docs" / "STATUS.md").read_text()
    start, end = text.find("<!-- verdicts:start -->"), text.find("<!-- verdicts:end -->")
    assert 0 <= start < end, "docs/STATUS.md lost its verdict markers"
    assert "| hypothesis |" in text[start:end]
    assert "verdicts:start" not in (ROOT / "README.md").read_text(), "verdicts go to docs/STATUS.md, not README.md"


# Rows published before the page had a check (measured at +dirty commits, on two machine types, or with
# h07's failed treatment jobs, and without a budget). The set only shrinks: a listed row that now holds
# fails the test below until it is removed here, and a row not listed must hold.
ROWS_BEFORE_THE_CHECK: set[str] = set()  # emptied when all eight sweeps were re-run at 2487a84


def test_every_published_status_row_is_from_one_clean_commit_one_machine_type_and_no_failed_job():
    from musique_rl.verdict import status_file_problems

    problems = status_file_problems(ROOT / "docs" / "STATUS.md")
    drifted = {h: p for h, p in problems.items() if h not in ROWS_BEFORE_THE_CHECK}
    assert not drifted, "rows that `python -m musique_rl.verdict publish` would have refused:\n" + "\n".join(
        f"{h}: {'; '.join(p)}" for h, p in drifted.items())
    now_clean = sorted(ROWS_BEFORE_THE_CHECK - set(problems))
    assert not now_clean, f"{now_clean} now hold: remove them from ROWS_BEFORE_THE_CHECK"


# A fenced bash block the docs mark `<!-- runnable -->` runs as written, in a fresh shell at the checkout's
# root (no environment beyond PATH and an empty HOME), and must exit 0; `<!-- runnable: refused ... -->`
# must exit non-zero with a RequirementError (a machine without vLLM and CUDA: this one, CI's).
RUNNABLE = re.compile(r"<!-- runnable(:[^>]*)? -->\n```bash\n(.*?)```", re.S)


def _runnable_blocks() -> list:
    blocks = []
    for page in DOCS:
        for n, m in enumerate(RUNNABLE.finditer(page.read_text()), 1):
            blocks.append(pytest.param(m.group(2), bool(m.group(1)) and "refused" in m.group(1),
                                       id=f"{page.relative_to(ROOT)}#{n}"))
    return blocks


def test_the_docs_mark_runnable_blocks_and_the_pattern_finds_them():
    ids = [p.id for p in _runnable_blocks()]
    assert any(i.startswith("README.md") for i in ids) and any(i.startswith("docs/howto/gpu.md") for i in ids), ids
    text = "<!-- runnable -->\n```bash\nmake x\n```\n<!-- runnable: refused here -->\n```bash\nmake y\n```\n"
    assert [(m.group(1), m.group(2)) for m in RUNNABLE.finditer(text)] == [(None, "make x\n"), (": refused here", "make y\n")]


@pytest.mark.parametrize(("block", "refused"), _runnable_blocks())
def test_a_runnable_block_runs_as_written_in_a_fresh_shell(block, refused, tmp_path):
    if not (ROOT / ".venv" / "bin" / "python").exists():
        pytest.skip("no .venv in this checkout (make setup builds it; CI has one)")
    if refused:
        from musique_rl.job.requirements import probe

        if probe().cuda or "vllm" in probe().modules:
            pytest.skip("a machine with CUDA or vLLM runs the job instead of refusing it")
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(tmp_path), "LANG": "C.UTF-8"}
    proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", block], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    if refused:
        assert proc.returncode != 0 and "RequirementError: this machine cannot run the job" in proc.stderr, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr
    else:
        assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"


# Data outside this repository is reached through one option (env.data_dir, default $MUSIQUE_RL_DATA:
# docs/howto/setup.md); no file sends the reader to another repository's folder or notes for it.
ELSEWHERE = re.compile(r"steering repo|\.\./shared/|/work/shared|GPU-NOTES|FIELD-NOTES", re.I)


def test_no_file_sends_the_reader_to_a_repository_outside_this_one():
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    files = ([ROOT / f for f in listed.stdout.splitlines()] if listed.returncode == 0 else
             [p for p in ROOT.rglob("*") if ".venv" not in p.parts and "multirun" not in p.parts])
    hits = []
    for path in files:
        if path.name == "test_docs.py" or not path.is_file() or path.suffix in (".png", ".safetensors", ".gz"):
            continue
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        hits += [f"{path.relative_to(ROOT)}:{n}: {line.strip()[:120]}" for n, line in enumerate(text.splitlines(), 1)
                 if ELSEWHERE.search(line)]
    assert not hits, "say $MUSIQUE_RL_DATA / env.data_dir, or cite a record in docs/records/:\n" + "\n".join(hits)
    assert ELSEWHERE.search("the steering repository's shared/") and ELSEWHERE.search("env.data=../shared/data/x")


def _record_module():
    spec = importlib.util.spec_from_file_location("record", ROOT / "benchmarks" / "record.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_benchmark_run_with_record_writes_its_output_under_a_provenance_header(tmp_path, capsys):
    record = _record_module()
    out = tmp_path / "records" / "bench.md"
    seen = []

    def main():
        seen.append(list(sys.argv))
        print("arm  tok/s\nhf   3119")
        return 1

    status = record.run(main, title="A bench", argv=["benchmarks/bench_x.py", "--turns", "4", "--record", str(out)])
    assert status == 1 and seen[0][1:] == ["--turns", "4"], "the bench's own arguments, without --record"
    assert "hf   3119" in capsys.readouterr().out, "the console still shows the output"
    text = out.read_text()
    assert text.startswith("# A bench\n")
    assert "`python benchmarks/bench_x.py --turns 4 --record" in text
    head = text.split("```text")[0]
    for field in ("- commit: ", "- machine: ", "- torch: ", "- dtype: float32", "- tokenizer: ", "- warm start: ", "- date: "):
        assert field in head, field
    sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    if sha:
        assert f"- commit: {sha}" in head
    assert "Output (exit status 1)" in text and "arm  tok/s\nhf   3119\n```" in text


def test_a_record_names_the_data_folder_as_a_stranger_has_it(tmp_path, monkeypatch):
    """A command that read the data outside the repository is recorded with $MUSIQUE_RL_DATA, not with
    this machine's path to it (which names a folder a stranger does not have)."""
    record = _record_module()
    data = tmp_path / "data"
    (data / "cases").mkdir(parents=True)
    monkeypatch.setenv("MUSIQUE_RL_DATA", str(data))
    out = tmp_path / "rec.md"
    record.run(lambda: print("ok"), title="A bench", argv=["bench_x.py", "--cases", str(data / "cases"), "--record", str(out)])
    assert "--cases $MUSIQUE_RL_DATA/cases" in out.read_text() and str(data) not in out.read_text()


def test_without_record_a_benchmark_writes_nothing(tmp_path, monkeypatch):
    record = _record_module()
    monkeypatch.chdir(tmp_path)
    assert record.run(lambda: None, title="A bench", argv=["bench_x.py", "--turns", "1"]) == 0
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("shape", ["tool", "arith"])
def test_the_records_name_the_shipped_warm_start_the_jobs_load(shape):
    name = _record_module().shipped_warm_start(shape)
    assert name.startswith("tiny-") and "(weights " in name, name


def test_a_benchmark_that_stops_on_bad_usage_keeps_the_record_that_is_there(tmp_path):
    record = _record_module()
    out = tmp_path / "bench.md"
    out.write_text("the last good record\n")

    def main():
        raise SystemExit(2)  # what argparse does on a bad argument

    with pytest.raises(SystemExit):
        record.run(main, title="A bench", argv=["bench_x.py", "--bogus", "--record", str(out)])
    assert out.read_text() == "the last good record\n"


# "the seeds'" meant the original researcher's setup and read like the `seed` parameter; "issue N"
# dates a comment instead of explaining it. Neither helps the next reader of the package.
UNCLEAR = re.compile(r"(?<![\w\[])seeds' [a-z]|\bissue \d+")


def test_package_comments_say_why_without_issue_numbers_or_the_seeds_wording():
    hits = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
            for p in sorted([*(ROOT / "musique_rl").rglob("*.py"), *(ROOT / "musique_rl").rglob("*.yaml")])
            for n, line in enumerate(p.read_text().splitlines(), 1) if UNCLEAR.search(line)]
    assert not hits, "say 'the original researcher's ...' and why, not the issue:\n" + "\n".join(hits)
    assert UNCLEAR.search("as the seeds' vf_musique") and UNCLEAR.search("(issue 12)")
    assert not UNCLEAR.search("f\"{v['n_seeds']} seed pairs\"")
