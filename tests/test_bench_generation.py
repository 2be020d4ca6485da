"""benchmarks/bench_generation.py on the tiny model: the table engines are compared by (prefill and
decode apart, every arm, the spread of the timed rounds), the bound's arithmetic (a CPU's against its
measured memcpy bandwidth), the static-cache arms' exactness checks, and its usage errors."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("bench_generation", ROOT / "benchmarks" / "bench_generation.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_card_table_finds_each_card_by_its_cuda_name(bench):
    assert bench.figures("NVIDIA H200") == (4.8e12, 989e12)
    assert bench.figures("NVIDIA H100 80GB HBM3")[0] == 3.35e12  # SXM
    assert bench.figures("NVIDIA H100 PCIe")[0] == 2.0e12
    assert bench.figures("NVIDIA A100-SXM4-80GB")[0] == 2.039e12
    assert bench.figures("NVIDIA GeForce GTX 1080") == (None, None)


def test_a_cpus_bound_is_its_measured_memcpy_bandwidth_and_says_so(bench):
    import torch

    name, bw, flops = bench.card(torch.device("cpu"))
    assert "a CPU figure" in name and "memcpy" in name and flops is None
    assert 1e8 < bw < 1e13  # bytes/s: between 0.1 GB/s and 10 TB/s


def test_the_table_holds_prefill_decode_and_the_bound_for_every_arm(bench, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench_generation.py", "--batch", "4", "--max-new-tokens", "6", "--turns", "2",
                                      "--backends", "hf,hf-static,paged,static", "--bandwidth", "1", "--peak-tflops", "1"])
    assert bench.main() == 0
    out = capsys.readouterr().out
    assert "batch=4" in out and "turns=2" in out and "repeats=3 (+1 untimed full-batch warm-up)" in out
    head = next(line for line in out.splitlines() if line.startswith("arm "))
    for column in ("end-to-end tok/s", "open+close s", "TTFT s/turn", "prefill tok/s", "decode tok/s", "decode % bound"):
        assert column in head
    arms = {"hf", "hf-static", "paged", "static"}
    rows = {line.split()[0]: line for line in out.splitlines() if line.split()[:1] and line.split()[0] in arms}
    assert set(rows) == arms
    assert " 1.00x " in rows["hf"] and "(" in rows["paged"] and "-" in rows["paged"]  # median (min-max)
    # 1 TB/s: decode <= 4 x 1e12 / the bytes read per step
    assert "decode <= B x bandwidth / bytes per step" in out
    for arm in ("hf-static", "static"):
        for mode in ("greedy (temperature 0)", "sampled (temperature 1.0, seed 0)"):
            line = next(x for x in out.splitlines() if x.startswith(f"exactness {arm} vs hf, {mode}"))
            assert ": 8/8 rows with identical tokens over 2 turn(s)" in line, line
    # the static backend's second turn prefilled only the tool turn: 4 contexts, 3 rounds + warm-up,
    # full and one-token sessions, far fewer tokens than re-encoding every context every turn
    line = next(x for x in out.splitlines() if x.startswith("static: decode step eager (no CUDA: no graphs)"))
    assert "cache 4 slots" in line


def test_fewer_than_three_rounds_or_an_unknown_backend_is_refused(bench, monkeypatch, capsys):
    for argv, said in ((["--repeats", "2"], "at least 3"), (["--backends", "hf,fast"], "unknown ['fast']")):
        monkeypatch.setattr(sys, "argv", ["bench_generation.py", *argv])
        with pytest.raises(SystemExit) as stop:
            bench.main()
        assert stop.value.code == 2 and said in capsys.readouterr().err
