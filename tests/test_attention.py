"""model.attn_implementation: auto works on any machine; an explicit choice this machine cannot
meet fails before any weights load, naming the package."""

from __future__ import annotations

import logging
import time

import pytest

from musique_rl.core import models


def test_auto_is_sdpa_without_flash_attn_and_says_so(caplog, monkeypatch):
    monkeypatch.setattr("transformers.utils.is_flash_attn_2_available", lambda: False)
    with caplog.at_level(logging.INFO, logger="musique_rl.core.models"):
        assert models.resolve_attention("auto", cuda=True) == "sdpa"
    assert "flash-attn not installed" in caplog.text
    assert models.resolve_attention("auto", cuda=False) == "sdpa"


def test_auto_takes_flash_attention_where_transformers_can_use_it(monkeypatch):
    monkeypatch.setattr("transformers.utils.is_flash_attn_2_available", lambda: True)
    assert models.resolve_attention("auto", cuda=True) == "flash_attention_2"
    assert models.resolve_attention("auto", cuda=False) == "sdpa"  # never on a CPU


def test_explicit_flash_attention_without_the_package_fails_in_a_second_naming_it(tmp_path, monkeypatch):
    from tests.conftest import compose_cfg

    monkeypatch.setattr("transformers.utils.is_flash_attn_2_available", lambda: False)
    cfg = compose_cfg(["model=qwen2.5-7b-instruct", f"model.name_or_path={tmp_path}", "model.dtype=float32",
                       "model.attn_implementation=flash_attention_2"])
    t0 = time.monotonic()
    with pytest.raises(ImportError, match="flash_attention_2 needs the flash-attn package.*pip install flash-attn"):
        models.load_model(cfg)  # tmp_path holds no model: it failed before trying to load one
    assert time.monotonic() - t0 < 2
    assert models.resolve_attention("sdpa") == "sdpa" and models.resolve_attention("eager") == "eager"


def test_every_real_model_config_defaults_to_auto():
    from tests.conftest import compose_cfg

    for name in ("qwen2.5-7b-instruct", "qwen2.5-3b-instruct", "llama3.1-8b-instruct", "qwen3-4b", "qwen3-8b"):
        assert str(compose_cfg([f"model={name}"]).model.attn_implementation) == "auto", name
