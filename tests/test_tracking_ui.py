"""The MLflow UI shows a clean and a faulted run side by side in its compare view (headless Chromium)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_compare_view_shows_both_runs(tmp_path):
    # a fresh machine: the script installs Debian's chromium + chromium-driver itself (apt-get)
    subprocess.run(["bash", str(ROOT / "launchers" / "install_browser.sh")], check=True, timeout=900)
    assert shutil.which("chromium") and shutil.which("chromedriver")
    out = tmp_path / "compare.png"
    proc = subprocess.run([sys.executable, str(ROOT / "launchers" / "mlflow_compare_screenshot.py"), "--demo",
                           "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["run_names_shown"] == ["train-s1", "fault-env_tokens_trained-s1"]
    assert "h02/env_tokens_with_loss" in report["diagnostic_metrics_shown"]
    assert out.stat().st_size > 20_000 and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
