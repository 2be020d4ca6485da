"""Dataset specs, validation and filters (musique_rl/env/data.py)."""

import copy
import json

import pytest
from omegaconf import OmegaConf

from musique_rl.env.data import InvalidRecordError, load_records, parse_spec
from musique_rl.schema import EnvSchema


def env(**kw):
    """A typed env group (it checks its own values when built, as a job's is)."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(EnvSchema(data="x")), kw))


def write_jsonl(path, records):
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return str(path)


def many(toy_record, n, hops=2):
    out = []
    for i in range(n):
        r = copy.deepcopy(toy_record)
        r["id"] = f"{hops}hop__{i}"
        if hops == 3:
            r["question_decomposition"].append(dict(r["question_decomposition"][1], paragraph_support_idx=0))
        out.append(r)
    return out


def test_spec_parsing():
    assert parse_spec("bdsaglam/musique,answerable,train[:256]") == [
        {"kind": "hub", "path": "bdsaglam/musique", "name": "answerable", "split": "train[:256]"}
    ]
    parts = parse_spec("a/b,x,train[:10]; /tmp/f.jsonl ;synthetic,default,validation;/tmp/g.json,,train[5:]")
    assert [p["kind"] for p in parts] == ["hub", "local", "synthetic", "local"]
    assert parts[3]["split"] == "train[5:]"
    with pytest.raises(ValueError, match="expected 'path,name,split'"):
        parse_spec("bdsaglam/musique,train")
    with pytest.raises(ValueError, match="env.data"):
        parse_spec(" ; ")


def test_local_jsonl_and_json_list_concat_slice_and_seeded_shuffle(tmp_path, toy_record):
    recs = many(toy_record, 10)
    a = write_jsonl(tmp_path / "a.jsonl", recs[:6])
    (tmp_path / "b.json").write_text(json.dumps(recs[6:]))
    spec = f"{a},x,train[:4];{tmp_path / 'b.json'}"
    out = load_records(spec, env(), seed=1)
    assert sorted(r["id"] for r in out) == sorted(["2hop__0", "2hop__1", "2hop__2", "2hop__3", "2hop__6", "2hop__7", "2hop__8", "2hop__9"])
    assert [r["id"] for r in load_records(spec, env(), seed=1)] == [r["id"] for r in out]
    assert [r["id"] for r in load_records(spec, env(), seed=2)] != [r["id"] for r in out]
    assert len(load_records(f"{a},x,train[:50%]", env(), seed=1)) == 3


def test_real_sample_loads_with_hop_filter(real_records, tmp_path):
    path = write_jsonl(tmp_path / "real.jsonl", real_records)
    stats = {}
    assert len(load_records(path, env(), seed=1, stats=stats)) == 60 and stats["kept"] == 60
    three = load_records(path, env(hops=[3]), seed=1)
    assert len(three) == 16 and all(len(r["question_decomposition"]) == 3 for r in three)


def test_missing_paragraphs_names_record_and_field(tmp_path, toy_record):
    bad = copy.deepcopy(toy_record)
    del bad["paragraphs"]
    path = write_jsonl(tmp_path / "bad.jsonl", [toy_record, bad])
    with pytest.raises(InvalidRecordError, match=r"record '2hop__1_2'.*field 'paragraphs' is missing"):
        load_records(path, env(), seed=1)


def test_support_idx_99_names_record_and_field(tmp_path, toy_record):
    bad = copy.deepcopy(toy_record)
    bad["id"] = "2hop__bad"
    bad["question_decomposition"][1]["paragraph_support_idx"] = 99
    path = write_jsonl(tmp_path / "bad.jsonl", [bad])
    with pytest.raises(InvalidRecordError, match=r"record '2hop__bad'.*question_decomposition\[1\]\.paragraph_support_idx.*99"):
        load_records(path, env(), seed=1)


def test_skip_invalid_skips_and_counts(tmp_path, toy_record, caplog):
    bad = copy.deepcopy(toy_record)
    bad["id"] = "2hop__bad"
    bad["answer"] = None
    path = write_jsonl(tmp_path / "mix.jsonl", [toy_record, bad])
    stats = {}
    out = load_records(path, env(skip_invalid=True), seed=1, stats=stats)
    assert [r["id"] for r in out] == [toy_record["id"]] and stats["invalid"] == 1
    assert "skipped 1 invalid record" in caplog.text


def test_answerable_filter(tmp_path, toy_record):
    un = dict(copy.deepcopy(toy_record), id="2hop__un", answerable=False)
    path = write_jsonl(tmp_path / "m.jsonl", [toy_record, un])
    assert [r["id"] for r in load_records(path, env(), seed=1)] == [toy_record["id"]]
    assert len(load_records(path, env(answerable_only=False), seed=1)) == 2


def test_noise_rate_keeps_supporting_and_drops_distractors_at_the_rate(real_records, tmp_path):
    path = write_jsonl(tmp_path / "r.jsonl", real_records)
    zero = load_records(path, env(noise_rate=0.0), seed=1)
    assert all(all(p["is_supporting"] for p in r["paragraphs"]) for r in zero)
    assert all(len(r["paragraphs"]) == len(r["question_decomposition"]) for r in zero)
    half = load_records(path, env(noise_rate=0.5), seed=1)
    distractors = sum(sum(not p["is_supporting"] for p in r["paragraphs"]) for r in half)
    total = sum(sum(not p["is_supporting"] for p in r["paragraphs"]) for r in real_records)
    assert 0.4 < distractors / total < 0.6
    assert all(sum(p["is_supporting"] for p in r["paragraphs"]) == len(r["question_decomposition"]) for r in half)
    # paragraph ids are the original idx (the model's citations stay meaningful)
    assert any(r["paragraphs"][-1]["idx"] != len(r["paragraphs"]) - 1 for r in half)
    with pytest.raises(ValueError, match=r"noise_rate=1.5: must be in \[0, 1\]"):
        env(noise_rate=1.5)  # refused by the env group itself, before any record is read


def test_max_paragraphs_caps_distractors_only(toy_record, tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [toy_record])
    (r,) = load_records(path, env(max_paragraphs=3), seed=1)
    assert [p["idx"] for p in r["paragraphs"]] == [0, 1, 4]


def test_offline_hub_error_says_how_to_use_a_local_file(monkeypatch):
    import datasets
    import huggingface_hub

    # datasets reads the *_OFFLINE variables at import: patch its resolved flags instead
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True, raising=False)
    with pytest.raises(RuntimeError, match="local file"):
        load_records("no-such-user/no-such-dataset,x,train[:2]", env(), seed=1)
