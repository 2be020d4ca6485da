"""Every config composes: each option of each group alone and with every hypothesis and fault.

Composition goes through Hydra's compose API on the real conf/ tree, with full resolution, so a
broken interpolation, a key missing from the typed schema or a wrong enum value fails here.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from musique_rl import schema
from musique_rl.core.config import TrainSettings
from musique_rl.core.faults import FAULTS as FAULT_REGISTRY
from musique_rl.env.config import EnvConfig
from musique_rl.schema import CONF_DIR, job_config  # importing it registers the schema and resolvers

ROOT = Path(__file__).resolve().parent.parent
GROUPS = ["model", "lora", "loss", "reward", "env"]


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


HYPOTHESES = options("hypothesis")
FAULTS = list(FAULT_REGISTRY)  # +fault=<name> overlays come from the declarations (musique_rl/core/faults/)


@pytest.fixture(scope="module", autouse=True)
def hydra_conf():
    # One Hydra initialisation for the module: re-initialising per composition costs ~0.2 s each.
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        yield


def resolved(overrides: list[str]) -> dict:
    cfg = compose(config_name="train", overrides=overrides)
    return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)


def test_every_group_has_options():
    for group in GROUPS:
        assert options(group), group
    assert HYPOTHESES == [f"h0{i}" for i in range(1, 9)]


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_option_composes_alone_and_with_every_hypothesis(group, option):
    base = resolved([f"{group}={option}"])
    assert base["hypothesis"] is None
    typed = job_config(compose(config_name="train", overrides=[f"{group}={option}"]))  # what a job receives
    assert dataclasses.asdict(getattr(typed, group)) == base[group]
    for hyp in HYPOTHESES:
        cfg = resolved([f"{group}={option}", f"+hypothesis={hyp}"])
        assert cfg["hypothesis"]["id"] == hyp


def _diff(a, b, prefix=""):
    """Dotted keys whose resolved values differ between two config dicts."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += _diff(a.get(k), b.get(k), f"{prefix}{k}.")
        return out
    return [] if a == b else [prefix.rstrip(".")]


@pytest.mark.parametrize("hyp", HYPOTHESES)
def test_hypothesis_treatment_differs_from_control(hyp):
    control = resolved([f"+hypothesis={hyp}", "hypothesis.arm=control"])
    treatment = resolved([f"+hypothesis={hyp}"])  # the overlay's default arm is the treatment
    knobs = [k for k in _diff(control, treatment) if not k.startswith("hypothesis.")]
    assert knobs, f"{hyp}: the treatment arm changes no knob"
    default = resolved([])
    changed_from_default = [k for k in _diff(default, treatment) if not k.startswith("hypothesis")]
    assert changed_from_default, f"{hyp}: the treatment equals the default config"


@pytest.mark.parametrize("hyp", HYPOTHESES)
def test_hypothesis_header_states_everything(hyp):
    text = (CONF_DIR / "hypothesis" / f"{hyp}.yaml").read_text()
    header = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    for word in ("Claim:", "Arms:", "Predicts:", "Criterion:", "priority", "Run:"):
        assert word in header, f"{hyp} header lacks {word!r}"
    meta = resolved([f"+hypothesis={hyp}"])["hypothesis"]
    assert meta["metric"] and meta["direction"] in ("increase", "decrease")


@pytest.mark.parametrize("fault", FAULTS)
def test_fault_composes_and_names_itself(fault):
    assert resolved([f"+fault={fault}"])["fault"] == fault
    assert resolved([])["fault"] == "none"  # never on by default


def test_the_job_config_is_typed_and_read_only():
    """schema.job_config: the groups as their dataclasses, every value of its field's type (enums
    included), and an assignment refused naming the field."""
    cfg = job_config(compose(config_name="train", overrides=["+hypothesis=h04", "hypothesis.arm=treatment"]))
    assert isinstance(cfg, schema.Config) and isinstance(cfg.env, EnvConfig) and isinstance(cfg.train, TrainSettings)
    assert cfg.env.max_turns == resolved(["+hypothesis=h04", "hypothesis.arm=treatment"])["env"]["max_turns"]
    assert cfg.loss.loss_type is schema.LossType.dapo and cfg.env.task == "musique"
    assert isinstance(cfg.model.tiny.cache_dir, str) and "${" not in cfg.model.tiny.cache_dir  # resolved
    with pytest.raises(dataclasses.FrozenInstanceError, match="EnvSchema.top_n"):
        cfg.env.top_n = 3
    assert job_config(cfg) is cfg  # already typed: handed on as it is
    with pytest.raises(TypeError, match="DictConfig"):
        job_config({"seed": 1})


def test_a_warm_start_setting_is_typed_by_the_schema_of_its_group():
    """conf/warm_start/<task>.yaml: env.* and model.tiny.* keys merged through their schema, so a
    value takes its field's type (the key hashes what a composed config holds) and a typo fails
    naming the key."""
    from musique_rl.base.config_base import overlay
    from musique_rl.env.config import warm_start_config

    cfg = job_config(compose(config_name="train", overrides=[]))
    assert overlay(cfg.model.tiny, {"sft_epochs": 6}).sft_epochs == 6.0
    assert overlay(cfg.env, {"synthetic": {"num_paragraphs": 4}}).synthetic.hops == cfg.env.synthetic.hops
    with pytest.raises(Exception, match="max_turn"):
        overlay(cfg.env, {"max_turn": 3})
    with pytest.raises(FileNotFoundError, match="env.task=nosuch"):
        warm_start_config("nosuch")
    for task in ("musique", "arith"):
        setting = warm_start_config(task)
        overlay(cfg.env, setting.env), overlay(cfg.model.tiny, setting.tiny)  # every key is a key of its group


def _config_classes() -> list[type]:
    from musique_rl.base.config_base import ReadOnly

    out, todo = [], [ReadOnly]
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo.extend(cls.__subclasses__())
    return [c for c in out if dataclasses.is_dataclass(c)]


def test_every_rule_names_a_field_of_its_class():
    """A rule keyed by a name its class does not have (a renamed field) is found here, not skipped."""
    classes = _config_classes()
    assert {"Config", "EnvSchema", "LoraConfig", "TrainSettings", "DiagnosticsConfig", "GpuSettings"} <= {
        c.__name__ for c in classes}
    ruled = 0
    for cls in classes:
        fields = {f.name for f in dataclasses.fields(cls)}
        assert set(cls.RULES) <= fields, f"{cls.__name__}.RULES names no field: {sorted(set(cls.RULES) - fields)}"
        ruled += len(cls.RULES) if "RULES" in vars(cls) else 0
    assert ruled >= 50  # the value checks schema._RULES held as dotted strings, now in their classes


def test_a_rule_for_a_renamed_field_is_an_error_not_a_skip():
    from musique_rl.base.config_base import POSITIVE

    @dataclasses.dataclass
    class Renamed(schema.LoraConfig):
        RULES = {**schema.LoraConfig.RULES, "rank": POSITIVE}  # noqa: RUF012  (lora.r once was lora.rank)

    with pytest.raises(TypeError, match="Renamed.RULES names 'rank'"):
        Renamed()


def test_bad_values_are_named_by_dotted_key_before_anything_is_built():
    cfg = compose(config_name="train", overrides=["gpu.vllm_gpu_memory_utilization=1.5", "lora.r=0",
                                                  "env.synthetic.hops=[2,0]", "train.importance_sampling_clip_min=4",
                                                  "env.retriever=lucene", "+reward.weights.answer_emm=1.0"])
    with pytest.raises(schema.ConfigValueError) as err:
        schema.validate(cfg)
    text = str(err.value)
    for problem in ("gpu.vllm_gpu_memory_utilization=1.5: must be in (0, 1]", "lora.r=0: must be >= 1",
                    "env.synthetic.hops=[2, 0]: must be hop counts the generator writes, each 2, 3 or 4",
                    "train.importance_sampling_clip_min=4.0 >= train.importance_sampling_clip_max=3.0",
                    "env.retriever=lucene searches a corpus-wide index: set env.scope=corpus",
                    "reward.weights.answer_emm: unknown reward component"):
        assert problem in text
    with pytest.raises(schema.ConfigValueError, match=r"lora.r=0: must be >= 1"):
        job_config(cfg)  # the typed config is never built from it
    with pytest.raises(schema.ConfigValueError, match=r"LoraConfig values that cannot work:\n  r=0: must be >= 1"):
        schema.LoraConfig(r=0)  # a group built in code checks itself (__post_init__)
    assert schema.LoraConfig(r=4).r == 4


def test_lora_alpha_is_twice_r_unless_set():
    assert resolved(["lora=r8"])["lora"]["lora_alpha"] == 16
    assert resolved(["lora=r64"])["lora"]["lora_alpha"] == 128
    assert resolved(["lora=r8", "lora.lora_alpha=7"])["lora"]["lora_alpha"] == 7


def test_loss_options_use_trl_names():
    for opt in options("loss"):
        assert resolved([f"loss={opt}"])["loss"]["loss_type"] == opt


def test_combined_reward_is_the_seeds_formula():
    r = resolved(["reward=combined"])["reward"]
    assert r["weights"] == {
        "answer_em": 1.0, "answer_f1": 0.9, "retrieval_recall": 1.0,
        "retrieval_precision": 0.4, "citation_recall": 0.6, "format": 0.1,
    }
    assert r["normalizer"] == 4.0 and r["hop_scale"] is True


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "musique_rl", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_cli_typo_fails_naming_the_key():
    out = _cli("loss.bta=0.1")
    assert out.returncode != 0
    assert "loss.bta: loss has no key 'bta' (did you mean beta?)" in out.stderr


def test_composing_a_config_imports_neither_torch_nor_transformers_nor_peft():
    """The schema and everything it registers (tasks, retrievers, faults, the instruments' config
    group) compose without the ML stack: a config error must not wait ~10 s for torch to import."""
    code = ("import sys, musique_rl.schema\n"
            "print(sorted(m for m in ('torch', 'transformers', 'peft', 'trl') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout


def test_a_mistyped_key_fails_at_once_with_the_key_it_is_closest_to():
    import time

    t0 = time.perf_counter()
    out = _cli("env.top_nn=3")
    wall = time.perf_counter() - t0
    assert out.returncode == 1 and "env.top_nn: env has no key 'top_nn' (did you mean top_n?)" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and "Key 'top_nn' not in" not in out.stderr  # before Hydra composes
    assert wall < 10, f"{wall:.1f} s: the check must not import the ML stack (about 0.6 s on a 2-core CPU)"


def test_unknown_keys_reads_the_schema_and_leaves_groups_and_additions_to_hydra():
    assert schema.unknown_keys(["train.max_stpes=3"]) == [
        "train.max_stpes: train has no key 'max_stpes' (did you mean max_steps?)"]
    assert schema.unknown_keys(["trian.max_steps=3"]) == ["trian.max_steps: the config has no key 'trian' (did you "
                                                          "mean train?)"]
    fine = ["model=tiny", "loss=grpo", "+hypothesis=h01", "hypothesis.arm=control", "+fault=adv_shuffled",
            "reward.weights.answer_em=1.0", "env.synthetic.hops=[2,3]", "seed=1,2,3", "hydra.run.dir=/tmp/x",
            "model.tiny.hidden_size=64", "-m", "--cfg", "job", "sweep.resume=/tmp/s", "~env.corpus", "++env.new=1"]
    assert schema.unknown_keys(fine) == []


def test_cli_bad_enum_lists_allowed_values():
    out = _cli("loss.loss_type=foo")
    assert out.returncode != 0
    text = out.stderr + out.stdout
    assert "foo" in text and all(v in text for v in ("grpo", "bnpo", "dr_grpo", "dapo"))


def test_cli_cfg_job_shows_hypothesis_knob():
    out = _cli("--cfg", "job", "--resolve", "+hypothesis=h01")
    assert out.returncode == 0, out.stderr
    assert "scale_rewards: none" in out.stdout
    default = _cli("--cfg", "job", "--resolve")
    assert "scale_rewards: group" in default.stdout
