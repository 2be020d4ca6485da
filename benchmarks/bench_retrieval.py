"""Retrieval speed, measured side by side in one run (not a timed test).

    .venv/bin/python benchmarks/bench_retrieval.py [--data PATH] [--corpus PATH] [--seconds 2]

Prints
- per-question bm25 (the default: each record's ~20 paragraphs) in queries/s, for the retriever
  as built (per-record bm25s indexes precomputed once, a query = vocabulary lookup + bm25s'
  get_scores over ~20 documents) and, for the ratio, for building the record's index per query
  (what a naive per-question retriever does). Target >= 10,000 queries/s.
- corpus-wide p50 / p95 latency over the corpus (1,890 paragraphs) for bm25 and lucene, after
  warm-up. Target <= 2 ms p50.
Queries are the MuSiQue sub-questions with '#k' replaced by earlier answers (the oracle's queries).
Defaults read the real sample in $MUSIQUE_RL_DATA/data/musique (default: shared/ inside or beside the checkout;
docs/howto/setup.md, "Data outside this repository"); without it, synthetic records are used.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from musique_rl.env.data import load_records  # noqa: E402
from musique_rl.env.retrieval import BM25Retriever, build_retriever  # noqa: E402
from musique_rl.env.tasks.musique import sub_questions  # noqa: E402
from musique_rl.schema import EnvSchema  # noqa: E402

SHARED = Path(os.environ.get("MUSIQUE_RL_DATA")
              or next((d for d in (ROOT / "shared", ROOT.parent / "shared") if d.is_dir()), ROOT.parent / "shared")) / "data" / "musique"


def env(**kw):
    return OmegaConf.merge(OmegaConf.structured(EnvSchema(data="x")), kw)


def throughput(fn, pairs, seconds: float) -> float:
    """Queries per second of fn(query, record) cycling over pairs for about `seconds`."""
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for rec, q in pairs:
            fn(q, rec)
        n += len(pairs)
    return n / (time.perf_counter() - start)


def latencies_ms(fn, pairs, rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        for rec, q in pairs:
            t = time.perf_counter()
            fn(q, rec)
            out.append((time.perf_counter() - t) * 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=str(SHARED / "train_sample_60.jsonl"))
    ap.add_argument("--corpus", default=str(SHARED / "corpus_1890.json"))
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=5, help="passes over the queries for latency percentiles")
    ap.add_argument("--skip-lucene", action="store_true")
    args = ap.parse_args()

    if Path(args.data).exists():
        records = load_records(args.data, env(), seed=1)
        corpus = args.corpus if Path(args.corpus).exists() else None
    else:
        print(f"{args.data} not found: using 200 synthetic records", file=sys.stderr)
        records = load_records("synthetic,default,validation", env(), seed=1)
        corpus = None
    pairs = [(r, q) for r in records for q in sub_questions(r)]
    n_par = sum(len(r["paragraphs"]) for r in records) / len(records)
    print(f"{len(records)} records ({n_par:.0f} paragraphs each), {len(pairs)} sub-question queries, top_n=1")

    # ---- per-question scope
    built = build_retriever(env(retriever="bm25"), records)  # precomputes every record's index

    def naive(q, rec):  # a fresh retriever per query: the index is rebuilt every call
        BM25Retriever("question").retrieve(q, rec, 1)

    fast = throughput(lambda q, rec: built.retrieve(q, rec, 1), pairs, args.seconds)
    slow = throughput(naive, pairs, args.seconds / 2)
    print("\nper-question bm25 (each record's own paragraphs)")
    print(f"  {'precomputed per-record index':32s} {fast:12,.0f} queries/s   (target >= 10,000)  {'OK' if fast >= 10_000 else 'BELOW TARGET'}")
    print(f"  {'index built per query':32s} {slow:12,.0f} queries/s   ratio {fast / slow:.1f}x")

    # ---- corpus scope
    cfg = dict(scope="corpus", corpus=corpus)
    rows = []
    names = ["bm25"] + ([] if args.skip_lucene else ["lucene"])
    for name in names:
        t0 = time.perf_counter()
        try:
            r = build_retriever(env(retriever=name, **cfg), records)
        except ImportError as e:
            print(f"  {name}: skipped ({e})")
            continue
        build_s = time.perf_counter() - t0
        latencies_ms(lambda q, rec, r=r: r.retrieve(q, rec, 1), pairs, 1)  # warm-up (JIT, caches)
        lat = latencies_ms(lambda q, rec, r=r: r.retrieve(q, rec, 1), pairs, args.rounds)
        q = statistics.quantiles(lat, n=100)
        rows.append((name, len(r.corpus), build_s, q[49], q[94]))
    print(f"\ncorpus-wide ({rows[0][1] if rows else '?'} paragraphs), latency per query after warm-up")
    print(f"  {'retriever':10s} {'build s':>8s} {'p50 ms':>8s} {'p95 ms':>8s}")
    for name, _, b, p50, p95 in rows:
        print(f"  {name:10s} {b:8.2f} {p50:8.3f} {p95:8.3f}   (target p50 <= 2 ms)  {'OK' if p50 <= 2 else 'ABOVE TARGET'}")
    if len(rows) == 2:
        print(f"  lucene/bm25 p50 ratio {rows[1][3] / rows[0][3]:.1f}x")


if __name__ == "__main__":
    main()
