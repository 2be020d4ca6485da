"""Open two runs side by side in the MLflow UI's compare view, headless, and save a screenshot.

    python launchers/mlflow_compare_screenshot.py --out compare.png                  # latest clean vs latest faulted run
    python launchers/mlflow_compare_screenshot.py --runs <id1> <id2> --out compare.png
    python launchers/mlflow_compare_screenshot.py --demo --out compare.png          # a throwaway store with two runs

It starts `mlflow server --workers 1` on 127.0.0.1 (a free port, job execution off) over the
tracking store (`--tracking-uri`, else $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db), drives
Debian's headless Chromium through Selenium (launchers/install_browser.sh installs it), waits
until the run names are on the page, saves the screenshot and stops the server.

Which view, from what the store holds (``choose_view``), said in one line before the browser starts:
a clean and a faulted run: their comparison; two runs of one kind: the two latest, compared; one
run (a newcomer's first ``make train``): its own page, and the command whose run a comparison
needs. Exit status 0 only when the page really shows the runs it was opened for; 2 when the store
holds no finished training run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

CHROMIUM_FLAGS = [
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
    "--window-size=1500,2600",  # tall: run details, params and metrics in one shot
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(uri: str, port: int, artifacts: str | None) -> subprocess.Popen:
    env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    mlflow_bin = str(Path(sys.executable).with_name("mlflow"))
    cmd = [mlflow_bin, "server", "--backend-store-uri", uri, "--host", "127.0.0.1", "--port", str(port),
           "--workers", "1"]
    if artifacts:
        cmd += ["--default-artifact-root", artifacts]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mlflow server exited: {proc.stderr.read()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.5)
    proc.terminate()
    raise RuntimeError("mlflow server did not answer /health within 120 s")


# what a second run adds, as the command that makes it (a planted fault the doctor names: docs/failure_modes.md)
FAULTED_RUN = "make train ARGS=+fault=stale_sampler"
CLEAN_RUN = "make train"


@dataclass(frozen=True)
class RunInfo:
    run_id: str
    experiment_id: str
    name: str
    fault: str  # the run's `fault` tag: "none" for a clean run
    hypothesis: str = "none"


@dataclass
class View:
    """What the UI check opens: ``runs`` (one: the run's page; two: the compare view) and why."""

    runs: list[RunInfo] = field(default_factory=list)
    message: str = ""

    @property
    def kind(self) -> str:
        return {0: "none", 1: "run"}.get(len(self.runs), "compare")

    def url(self, base_url: str) -> str:
        if self.kind == "run":
            r = self.runs[0]
            return f"{base_url}/#/experiments/{r.experiment_id}/runs/{r.run_id}"
        runs = [r.run_id for r in self.runs]
        exps = sorted({r.experiment_id for r in self.runs})
        query = f"runs={urllib.parse.quote(json.dumps(runs))}&experiments={urllib.parse.quote(json.dumps(exps))}"
        return f"{base_url}/#/compare-runs?{query}"


def choose_view(runs: list[RunInfo], uri: str) -> View:
    """The view ``runs`` (finished training runs, newest first) allow, and what a next run would add."""
    clean = [r for r in runs if r.fault == "none"]
    # prefer a plain clean run (no hypothesis arm) over a hypothesis sweep's job
    clean.sort(key=lambda r: r.hypothesis != "none")
    faulted = [r for r in runs if r.fault != "none"]
    if clean and faulted:
        pair = [clean[0], faulted[0]]
        return View(pair, f"comparing the latest clean run ({pair[0].name}) with the latest faulted run ({pair[1].name})")
    if not runs:
        return View([], f"no finished training run in {uri}: run `{CLEAN_RUN}` first (or pass --demo for a "
                        "throwaway store with two runs)")
    wanted = (f"a faulted run (`{FAULTED_RUN}`) shows what the doctor's instruments catch beside it" if clean else
              f"a clean run (`{CLEAN_RUN}`) shows what the fault changed")
    if len(runs) == 1:
        return View(runs[:1], f"one run found ({runs[0].name}): showing its metrics page; {wanted}, "
                              "and `make ui-check` then compares the two")
    pair = (clean or faulted)[:2]
    kind = "clean" if clean else "faulted"
    return View(pair, f"no {'faulted' if clean else 'clean'} run yet: comparing the two latest {kind} runs "
                      f"({pair[0].name}, {pair[1].name}); {wanted}")


def finished_runs(uri: str) -> list[RunInfo]:
    """The store's finished training runs (no sweep parent, no eval job), newest first."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exps = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(exps, "attributes.status = 'FINISHED'", order_by=["attributes.start_time DESC"])
    return [RunInfo(r.info.run_id, r.info.experiment_id, r.data.tags.get("mlflow.runName", r.info.run_id),
                    r.data.tags.get("fault", "none"), r.data.tags.get("hypothesis", "none"))
            for r in runs if r.data.tags.get("sweep_parent") != "true" and r.data.tags.get("mode", "train") == "train"]


def demo_store(root: Path) -> tuple[str, list[str], list[str]]:
    """A throwaway store with a clean and a faulted run carrying instrument-shaped metrics."""
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from musique_rl.tracking.store import ensure_experiment

    uri = f"sqlite:///{root / 'mlflow.db'}"
    exp = ensure_experiment(uri, "musique_rl")
    client = MlflowClient(uri)
    ids = []
    for name, fault, env_tokens in (("train-s1", "none", 0.0), ("fault-env_tokens_trained-s1", "env_tokens_trained", 180.0)):
        rid = client.create_run(exp, run_name=name, tags={"fault": fault, "seed": "1", "mode": "train"}).info.run_id
        client.log_param(rid, "fault", fault)
        client.log_batch(rid, metrics=[Metric(k, v, 0, s) for s in range(10) for k, v in (
            ("reward", 0.5 + (0.03 * s if fault == "none" else 0.0)),
            ("h02/env_tokens_with_loss", env_tokens),
            ("h08/update_weight_ratio", 1e-3))])
        client.set_tag(rid, "diagnosis", "clean" if fault == "none" else "h02")
        client.set_terminated(rid)
        ids.append(rid)
    return uri, ids, [exp]


def screenshot(url: str, out: Path, expect: list[str]) -> str:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.support.ui import WebDriverWait

    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    driver_bin = shutil.which("chromedriver") or "/usr/bin/chromedriver"
    if not Path(chromium).exists() or not Path(driver_bin).exists():
        raise SystemExit("needs Debian's chromium and chromium-driver: run launchers/install_browser.sh (apt-get, as root)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for f in CHROMIUM_FLAGS:
        opts.add_argument(f)
    driver = webdriver.Chrome(service=Service(executable_path=driver_bin), options=opts)
    try:
        driver.get(url)
        # the compare view renders client-side: wait until every expected text is on the page
        WebDriverWait(driver, 90).until(lambda d: all(t in d.find_element("tag name", "body").text for t in expect))
        _arrange(driver)
        time.sleep(2)  # let charts finish drawing
        driver.save_screenshot(str(out))
        return driver.find_element("tag name", "body").text
    finally:
        driver.quit()


def _arrange(driver) -> None:
    """Close MLflow 3's Assistant side panel (it hides half of the view) and switch the parameter,
    metric and tag tables to "Show diff only", so what differs between the two runs is what shows."""
    from selenium.common.exceptions import WebDriverException

    for label in ("Close", "Parameters - Show diff only", "Metrics - Show diff only", "Tags - Show diff only"):
        try:
            for button in driver.find_elements("css selector", f'button[aria-label="{label}"]'):
                button.click()
        except WebDriverException:
            pass  # a newer UI without that control: the screenshot is still taken
    # clicking scrolled the view down to the last toggle: back to the top of every scroller
    driver.execute_script("for (const e of document.querySelectorAll('*')) { if (e.scrollTop) e.scrollTop = 0; }"
                          " window.scrollTo(0, 0);")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", nargs="+", metavar="RUN_ID",
                    help="one run (its page) or two (compared); default: what the store holds (choose_view)")
    ap.add_argument("--tracking-uri", default=os.environ.get("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db"))
    ap.add_argument("--demo", action="store_true", help="make a throwaway store with a clean and a faulted run")
    ap.add_argument("--out", type=Path, default=Path("mlflow_compare.png"))
    args = ap.parse_args(argv)

    from mlflow.tracking import MlflowClient

    tmp = tempfile.TemporaryDirectory() if args.demo else None
    if tmp is not None:
        uri, ids, _ = demo_store(Path(tmp.name))
    else:
        uri, ids = args.tracking_uri, list(args.runs or [])
    if ids:
        client = MlflowClient(uri)
        got = [client.get_run(r) for r in ids[:2]]
        view = View([RunInfo(r.info.run_id, r.info.experiment_id, r.data.tags.get("mlflow.runName", r.info.run_id),
                             r.data.tags.get("fault", "none")) for r in got], "the runs asked for")
    else:
        view = choose_view(finished_runs(uri), uri)
    print(f"ui-check: {view.message}", flush=True)
    if view.kind == "none":
        return 2
    names = [r.name for r in view.runs]
    port = free_port()
    server = start_server(uri, port, None)
    try:
        text = screenshot(view.url(f"http://127.0.0.1:{port}"), args.out, expect=names)
    finally:
        server.terminate()
        server.wait(timeout=30)
        if tmp is not None:
            tmp.cleanup()
    shown = [n for n in names if n in text]
    print(json.dumps({"screenshot": str(args.out), "view": view.kind, "runs": [r.run_id for r in view.runs],
                      "run_names_shown": shown, "message": view.message,
                      "diagnostic_metrics_shown": sorted({w for w in text.split() if w.startswith(("h0", "preflight/"))})[:20]}))
    return 0 if len(shown) == len(names) else 1


if __name__ == "__main__":
    raise SystemExit(main())
