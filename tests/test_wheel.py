"""The package as a user installs it: a wheel built from the checkout, installed into a fresh venv,
run from a directory outside the checkout. It proves the top-level conf/, sweeps/ and launchers/
(mapped into the package at build time) and the warm start ship inside the package (schema.CONF_DIR
and its siblings) and that nothing reads the source tree at run time.

The fresh venv gets the dependencies through a .pth line naming the current environment's
site-packages: a plain path line adds the directory without running its .pth files, so the
editable install of the checkout there (a meta-path finder started by a .pth) is never active and
``musique_rl`` can only come from the wheel. Reinstalling torch, transformers, ... would take
minutes and need the network; this takes seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# What the wheel is built from (pyproject.toml's packages and package data, README.md its readme);
# copied first so that the build's own build/ directory never lands in the checkout.
SOURCES = ("pyproject.toml", "README.md", "musique_rl", "hydra_plugins", "conf", "sweeps", "launchers")


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: int) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(python of a fresh venv holding only the wheel, a clean environment, a directory outside the checkout)."""
    import shutil

    try:
        import setuptools  # noqa: F401  (the build backend; without build isolation nothing is downloaded)
    except ImportError:
        pytest.skip("building the wheel offline needs setuptools in this environment (pip install -e '.[dev]')")
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(ROOT / name, src / name)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
          "-w", str(tmp / "dist"), str(src)], cwd=tmp, env=env, timeout=300)
    wheel = next((tmp / "dist").glob("musique_rl-*.whl"))

    venv.create(tmp / "venv", with_pip=False, symlinks=True)
    python = tmp / "venv" / "bin" / "python"
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                     cwd=tmp, env=env, timeout=60).stdout.strip())
    (site / "_deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    _run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--no-compile", "-q",
          "--target", str(site), str(wheel)], cwd=tmp, env=env, timeout=300)
    outside = tmp / "elsewhere"
    outside.mkdir()
    return python, site, env, outside


def test_pyproject_lists_every_package_of_the_checkout():
    """pyproject.toml lists the packages by name (a package-dir mapping cannot be combined with
    automatic discovery): a new subpackage left out of the list would be missing from the wheel."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for top in ("musique_rl", "hydra_plugins")
             for p in (ROOT / top).rglob("__init__.py")}
    assert found <= listed, f"add to pyproject.toml [tool.setuptools] packages: {sorted(found - listed)}"


def test_the_wheel_holds_what_the_package_reads_at_run_time(installed):
    python, site, env, outside = installed
    from musique_rl.gpu_job import ACCELERATE_DIR
    from musique_rl.schema import CONF_DIR, LAUNCHERS_DIR, SWEEPS_DIR

    def files(d: Path) -> list[str]:
        return sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file() and "__pycache__" not in p.parts)

    conf = site / "musique_rl" / "conf"
    assert (conf / "train.yaml").is_file() and (site / "musique_rl" / "sweeps" / "_base.yaml").is_file()
    # every config, named sweep and launcher config of the checkout's top-level folders ships (pyproject's
    # package-dir mapping and package-data globs leave none behind), as a real file
    assert files(conf) == files(CONF_DIR)
    assert files(site / "musique_rl" / "sweeps") == files(SWEEPS_DIR)
    assert files(site / "musique_rl" / "launchers" / "accelerate") == files(ACCELERATE_DIR)
    assert files(site / "musique_rl" / "launchers" / "hydra") == files(LAUNCHERS_DIR / "hydra")
    assert list((site / "musique_rl" / "warm_starts").glob("tiny-*/model/model.safetensors"))
    proc = _run([str(python), "-c", "import musique_rl, hydra_plugins.musique_rl_launchers as l, musique_rl.schema as s, "
                 "musique_rl.gpu_job as g; print(musique_rl.__file__, l.__file__, s.CONF_DIR, g.DEFAULT_ACCELERATE_CONFIG)"],
                cwd=outside, env=env, timeout=120)
    paths = proc.stdout.split()
    assert len(paths) == 4 and all(p.startswith(str(site)) for p in paths), proc.stdout


def test_the_installed_command_composes_and_trains_outside_the_checkout(installed):
    python, site, env, outside = installed
    job = _run([str(python), "-m", "musique_rl", "--cfg", "job"], cwd=outside, env=env, timeout=120)
    assert "model:" in job.stdout and "train:" in job.stdout
    search = _run([str(python), "-m", "musique_rl", "--info", "searchpath"], cwd=outside, env=env, timeout=120)
    assert str(site / "musique_rl" / "conf") in search.stdout and str(ROOT) not in search.stdout, search.stdout

    # a user's own option in their own config dir, next to the shipped groups (README, Configuration)
    mine = outside / "my_conf" / "reward"
    mine.mkdir(parents=True)
    shipped = (site / "musique_rl" / "conf" / "reward" / "combined.yaml").read_text()
    (mine / "mine.yaml").write_text(shipped.replace("name: combined", "name: mine").replace("normalizer: 4.0", "normalizer: 7.0"))
    own = _run([str(python), "-m", "musique_rl", "--config-dir", "my_conf", "reward=mine", "loss=grpo", "--cfg", "job"],
               cwd=outside, env=env, timeout=120)
    assert "normalizer: 7.0" in own.stdout and "loss_type: grpo" in own.stdout, own.stdout

    run_dir = outside / "run"
    _run([str(python), "-m", "musique_rl", "train.max_steps=2", "train.prompts_per_step=2", "train.num_generations=4",
          "train.eval_episodes=4", "tracking.enabled=false", f"hydra.run.dir={run_dir}"],
         cwd=outside, env={**env, "OMP_NUM_THREADS": "1"}, timeout=300)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics, "metrics.json is empty"
    hydra_cfg = (run_dir / ".hydra" / "hydra.yaml").read_text()
    assert str(site / "musique_rl" / "conf") in hydra_cfg  # the configs the job composed came from the wheel
    assert not (ROOT / "outputs" / run_dir.name).exists()
