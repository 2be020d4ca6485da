"""`make ui-check` after a newcomer's first `make train`: which MLflow view it opens and what it says
a second run would add (launchers/mlflow_compare_screenshot.py). No browser here: the server and the
screenshot are stood in for; tests/test_tracking_ui.py drives the real one where Chromium exists."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("ui_check", ROOT / "launchers" / "mlflow_compare_screenshot.py")
ui = sys.modules["ui_check"] = importlib.util.module_from_spec(_spec)  # dataclasses look their module up
_spec.loader.exec_module(ui)


def run(name: str, fault: str = "none", hyp: str = "none") -> ui.RunInfo:
    return ui.RunInfo(f"id-{name}", "1", name, fault, hyp)


def test_one_run_shows_its_page_and_names_the_run_a_comparison_needs():
    view = ui.choose_view([run("train-s1")], "sqlite:///mlflow.db")
    assert view.kind == "run" and view.url("http://h").endswith("/#/experiments/1/runs/id-train-s1")
    assert view.message.startswith("one run found (train-s1): showing its metrics page")
    assert "`make train ARGS=+fault=stale_sampler`" in view.message
    alone = ui.choose_view([run("fault-stale_sampler-s1", "stale_sampler")], "u")
    assert alone.kind == "run" and "a clean run (`make train`)" in alone.message


def test_a_clean_and_a_faulted_run_are_compared_a_plain_run_first():
    runs = [run("h02-treatment-s1", hyp="h02"), run("fault-stale_sampler-s1", "stale_sampler"), run("train-s1"),
            run("fault-kl_flipped-s1", "kl_flipped")]
    view = ui.choose_view(runs, "u")
    assert view.kind == "compare" and [r.name for r in view.runs] == ["train-s1", "fault-stale_sampler-s1"]
    assert "compare-runs?runs=" in view.url("http://h")


def test_two_runs_of_one_kind_are_compared_and_the_missing_kind_named():
    view = ui.choose_view([run("train-s2"), run("train-s1"), run("train-s0")], "u")
    assert [r.name for r in view.runs] == ["train-s2", "train-s1"]
    assert view.message.startswith("no faulted run yet: comparing the two latest clean runs") and ui.FAULTED_RUN in view.message


def test_an_empty_store_says_what_to_run():
    view = ui.choose_view([], "sqlite:///x.db")
    assert view.kind == "none" and "no finished training run in sqlite:///x.db: run `make train` first" in view.message


@pytest.fixture
def store(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("musique_rl")

    def add(name: str, fault: str = "none", mode: str = "train", finish: bool = True) -> str:
        rid = client.create_run(exp, run_name=name, tags={"fault": fault, "mode": mode, "hypothesis": "none"}).info.run_id
        if finish:
            client.set_terminated(rid)
        return rid

    return uri, add


def test_after_a_first_make_train_the_check_opens_that_run_and_exits_0(store, tmp_path, monkeypatch, capsys):
    uri, add = store
    assert ui.main(["--tracking-uri", uri, "--out", str(tmp_path / "c.png")]) == 2  # nothing yet: rc 2, said
    assert "no finished training run" in capsys.readouterr().out
    rid = add("train-s1")
    add("eval-s1", mode="eval")  # not a training run
    add("train-s2", finish=False)  # still running
    opened = []
    monkeypatch.setattr(ui, "start_server", lambda *a: type("P", (), {"terminate": lambda s: None,
                                                                      "wait": lambda s, timeout: 0})())
    monkeypatch.setattr(ui, "screenshot", lambda url, out, expect: opened.append(url) or "train-s1 reward 0.5")
    assert ui.main(["--tracking-uri", uri, "--out", str(tmp_path / "c.png")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("ui-check: one run found (train-s1): showing its metrics page")
    assert opened[0].endswith(f"/runs/{rid}")
    report = json.loads(out[-1])
    assert report["view"] == "run" and report["run_names_shown"] == ["train-s1"]
