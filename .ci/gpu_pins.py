#!/usr/bin/env python3
"""Do the `gpu` extra's pins resolve with the project's own, on Python 3.11 and 3.12, against PyPI?

    python .ci/gpu_pins.py                  # both Pythons; exit 1 naming the conflict (make check-gpu-pins)
    python .ci/gpu_pins.py --python 3.12    # one

What `pip install -e '.[gpu]'` on a Linux x86-64 GPU node resolves, without installing or
downloading the large wheels: `pip install --dry-run --report` for the target Python
(`--python-version`, manylinux x86-64 tags up to glibc 2.35), from PyPI only (`--isolated`: this
machine's pip config, local wheels and constraints are left out). Such a cross-target resolution
takes wheels only, so the two pinned packages published as sdists only (deepspeed, and
antlr4-python3-runtime 4.9.3 that omegaconf 2.3 pins) are built here first (`pip wheel --no-deps`,
pure Python, ~15 s) and offered as local wheels. Then: the resolved vLLM lies in the range the pinned
TRL declares for its `vllm` extra. About 2 minutes, most of it pip reading vLLM's and torch's metadata.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTHONS = ("3.11", "3.12")
# sdist-only requirements of the gpu install (no wheel on PyPI): built here, offered as local wheels
SDIST_ONLY = {"deepspeed": None, "antlr4-python3-runtime": "4.9.3"}  # None: the version pyproject pins
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(35, 16, -1)] + ["manylinux2014_x86_64"]
SHOWN = ("vllm", "torch", "transformers", "trl", "peft", "deepspeed", "flashinfer-python", "numpy")


def requirements() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [*project["dependencies"], *project["optional-dependencies"]["gpu"]]


def pip(*args: str) -> list[str]:
    cert = os.environ.get("PIP_CERT")  # --isolated drops the environment's CA bundle: keep it
    return [sys.executable, "-m", "pip", "--isolated", "--disable-pip-version-check", *(["--cert", cert] if cert else []),
            *args]


def build_sdists(reqs: list[str], dest: Path) -> None:
    pinned = {r.split("==")[0].strip(): r.split("==")[1].split(";")[0].strip() for r in reqs if "==" in r}
    wanted = [f"{name}=={version or pinned[name]}" for name, version in SDIST_ONLY.items()]
    subprocess.run(pip("wheel", "--no-deps", "-q", "-w", str(dest), *wanted), check=True)


def resolve(python: str, reqs: list[str], wheels: Path, work: Path) -> dict[str, dict]:
    report = work / f"report-{python}.json"
    abi = "cp" + python.replace(".", "")
    cmd = pip("install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report),
              "--index-url", "https://pypi.org/simple", "--find-links", str(wheels), "--only-binary=:all:",
              "--python-version", python, "--implementation", "cp", "--abi", abi,
              *[x for p in PLATFORMS for x in ("--platform", p)], "--target", str(work / "target"), *reqs)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        errors = [ln for ln in proc.stderr.splitlines() if not ln.startswith("WARNING")]
        hint = (f"\n(a package published without a wheel: add it to SDIST_ONLY in {Path(__file__).name})"
                if "No matching distribution" in proc.stderr else "")
        raise SystemExit(f"gpu pins: Python {python}: pip cannot resolve them:\n" + "\n".join(errors[-25:]) + hint)
    return {i["metadata"]["name"].lower(): i["metadata"] for i in json.loads(report.read_text())["install"]}


def trl_vllm_range(resolved: dict[str, dict]) -> str:
    """The specifier TRL's metadata gives its `vllm` extra (e.g. ">=0.22.0,<=0.31.0")."""
    from packaging.requirements import Requirement

    for text in resolved["trl"].get("requires_dist", []):
        req = Requirement(text)
        if req.name == "vllm" and req.marker is not None and req.marker.evaluate({"extra": "vllm"}):
            return str(req.specifier)
    raise SystemExit("gpu pins: TRL's metadata declares no vllm extra")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--python", action="append", choices=PYTHONS, help="default: both")
    a = ap.parse_args(argv)
    from packaging.specifiers import SpecifierSet

    reqs = requirements()
    gpu = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    print(f"gpu pins: pyproject's gpu extra {gpu} with the project's dependencies, against PyPI", flush=True)
    bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        build_sdists(reqs, work / "wheels")
        for python in a.python or PYTHONS:
            resolved = resolve(python, reqs, work / "wheels", work)
            versions = ", ".join(f"{n} {resolved[n]['version']}" for n in SHOWN if n in resolved)
            span = trl_vllm_range(resolved)
            ok = resolved["vllm"]["version"] in SpecifierSet(span)
            bad += not ok
            print(f"  Python {python}: {versions} ({len(resolved)} packages); vLLM "
                  f"{'within' if ok else 'OUTSIDE'} TRL {resolved['trl']['version']}'s range {span}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
