"""Open two runs side by side in the MLflow UI's compare view, headless, and save a screenshot.

    python launchers/mlflow_compare_screenshot.py --out compare.png                  # latest clean vs latest faulted run
    python launchers/mlflow_compare_screenshot.py --runs <id1> <id2> --out compare.png
    python launchers/mlflow_compare_screenshot.py --demo --out compare.png          # a throwaway store with two runs

It starts `mlflow server --workers 1` on 127.0.0.1 (a free port, job execution off) over the
tracking store (`--tracking-uri`, else $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db), drives
Debian's headless Chromium through Selenium (launchers/install_browser.sh installs it), waits
until both run names and a diagnostic metric are on the page, saves the screenshot and stops the
server. Exit status 0 only when the compare view really shows both runs.
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


def pick_runs(uri: str) -> tuple[list[str], list[str]]:
    """The latest finished clean run (tag fault=none) and the latest finished faulted run."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exps = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(exps, "attributes.status = 'FINISHED'", order_by=["attributes.start_time DESC"])
    runs = [r for r in runs if r.data.tags.get("sweep_parent") != "true" and r.data.tags.get("mode", "train") == "train"]
    # prefer a plain clean run (no hypothesis arm) over a hypothesis sweep's job
    clean = next((r for r in runs if r.data.tags.get("fault") == "none" and r.data.tags.get("hypothesis") == "none"),
                 next((r for r in runs if r.data.tags.get("fault") == "none"), None))
    faulted = next((r for r in runs if r.data.tags.get("fault", "none") != "none"), None)
    if clean is None or faulted is None:
        raise SystemExit(f"need a finished clean run and a finished faulted run in {uri}; pass --runs or --demo")
    return [clean.info.run_id, faulted.info.run_id], sorted({clean.info.experiment_id, faulted.info.experiment_id})


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


def screenshot(base_url: str, runs: list[str], experiments: list[str], out: Path, expect: list[str]) -> str:
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
    query = f"runs={urllib.parse.quote(json.dumps(runs))}&experiments={urllib.parse.quote(json.dumps(experiments))}"
    url = f"{base_url}/#/compare-runs?{query}"
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
    ap.add_argument("--runs", nargs=2, metavar="RUN_ID", help="the two runs (default: latest clean vs latest faulted)")
    ap.add_argument("--tracking-uri", default=os.environ.get("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db"))
    ap.add_argument("--demo", action="store_true", help="make a throwaway store with a clean and a faulted run")
    ap.add_argument("--out", type=Path, default=Path("mlflow_compare.png"))
    args = ap.parse_args(argv)

    from mlflow.tracking import MlflowClient

    tmp = tempfile.TemporaryDirectory() if args.demo else None
    if tmp is not None:
        uri, runs, exps = demo_store(Path(tmp.name))
    else:
        uri = args.tracking_uri
        if args.runs:
            client = MlflowClient(uri)
            runs = list(args.runs)
            exps = sorted({client.get_run(r).info.experiment_id for r in runs})
        else:
            runs, exps = pick_runs(uri)
    client = MlflowClient(uri)
    names = [client.get_run(r).data.tags.get("mlflow.runName", r) for r in runs]
    port = free_port()
    server = start_server(uri, port, None)
    try:
        text = screenshot(f"http://127.0.0.1:{port}", runs, exps, args.out, expect=names)
    finally:
        server.terminate()
        server.wait(timeout=30)
        if tmp is not None:
            tmp.cleanup()
    shown = [n for n in names if n in text]
    print(json.dumps({"screenshot": str(args.out), "runs": runs, "run_names_shown": shown,
                      "diagnostic_metrics_shown": sorted({w for w in text.split() if w.startswith(("h0", "preflight/"))})[:20]}))
    return 0 if len(shown) == 2 else 1


if __name__ == "__main__":
    raise SystemExit(main())
