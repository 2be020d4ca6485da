"""Independent-path instruments and the doctor's new findings, on hand-made inputs (no training):
the reward audit catches a reward attached to another sample, environment integrity a cut document,
the sampling fit a sampler temperature the trainer does not use; the doctor files a step-0 gap that
a sampling setting explains under h06, and a flat run with nothing flagged as 'cause not found'."""

from __future__ import annotations

import torch

from musique_rl.doctor.diagnose import diagnose_metrics
from musique_rl.env import rewards, tools
from musique_rl.env.episode import EpisodeSummary
from musique_rl.instruments.audit import RewardAudit, environment_integrity
from musique_rl.instruments.ledger import Source
from musique_rl.instruments.sync import logp_gap, sampling_fit
from tests.test_doctor import clean, series, with_


class CharTokenizer:
    """One id per character (id = code point + 10); 1 = eos. Enough to decode turns."""

    eos_token_id, pad_token_id = 1, 0

    def encode(self, text: str) -> list[int]:
        return [ord(c) + 10 for c in text]

    def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=None) -> str:
        return "".join(chr(i - 10) for i in ids if i >= 10)

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=False, tokenize=False) -> str:
        """A template that renders each content as it is, between role markers."""
        return "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages) + (
            "<assistant>" if add_generation_prompt else "")


def _episode(record, answer: str, doc_text: str | None = None):
    p = record["paragraphs"][1]
    doc = {"id": str(p["idx"]), "title": p["title"], "text": p["paragraph_text"] if doc_text is None else doc_text}
    call = '<tool_call>{"name": "retrieve_documents", "arguments": {"query": "q"}}</tool_call>'
    final = f"<think>t</think><cite>[{p['idx']}]</cite><answer>{answer}</answer>"
    tool = tools.format_documents([doc])
    msgs = [{"role": "user", "content": record["question"]}, {"role": "assistant", "content": call},
            {"role": "tool", "content": tool}, {"role": "assistant", "content": final}]
    tok = CharTokenizer()
    ids = tok.encode(call) + [1] + [5] + tok.encode(tool) + [5] + tok.encode(final) + [1]
    src = ([Source.ASSISTANT] * (len(call) + 1) + [Source.TEMPLATE] + [Source.TOOL] * len(tool) + [Source.TEMPLATE]
           + [Source.ASSISTANT] * (len(final) + 1))
    return EpisodeSummary(record["id"], msgs), ids, [int(s) for s in src]


def _batch(record, answers):
    eps, ids, srcs = zip(*(_episode(record, a) for a in answers), strict=True)
    width = max(map(len, ids))
    pad = lambda rows: torch.tensor([r + [0] * (width - len(r)) for r in rows])  # noqa: E731
    return list(eps), pad(list(ids)), pad(list(srcs))


def test_reward_audit_matches_honest_rewards_and_catches_shifted_ones(toy_record):
    from omegaconf import OmegaConf

    from tests.conftest import compose_cfg

    reward_cfg = compose_cfg([]).reward
    by_id = {toy_record["id"]: toy_record}
    answers = [toy_record["answer"], "wrong", toy_record["answer"], "nope"]
    eps, ids, srcs = _batch(toy_record, answers)
    honest = torch.tensor([rewards.total(rewards.score_episode(toy_record, e.messages), rewards.n_hops(toy_record),
                                         reward_cfg) for e in eps])
    audit = RewardAudit(OmegaConf.create(OmegaConf.to_container(reward_cfg)), by_id, CharTokenizer(), audit_size=4)
    ok = audit(honest, eps, ids, srcs)
    assert ok["h05/reward_audit_checked"] == 4 and ok["h05/reward_audit_mismatch"] == 0
    shifted = torch.roll(honest, 1)  # reward of the neighbouring sample
    bad = audit(shifted, eps, ids, srcs)
    assert bad["h05/reward_audit_mismatch"] == 4 and bad["h05/reward_audit_abs_diff_max"] > 0.1


def test_environment_integrity_counts_cut_and_relabelled_documents(toy_record):
    by_id = {toy_record["id"]: toy_record}
    good, ids, srcs = _episode(toy_record, "x")
    assert environment_integrity([good], by_id, CharTokenizer(), torch.tensor([ids]), torch.tensor([srcs]))[
        "h04/tool_results_altered"] == 0
    cut, _, _ = _episode(toy_record, "x", doc_text=toy_record["paragraphs"][1]["paragraph_text"][:20])
    out = environment_integrity([good, cut], by_id)
    assert out["h04/tool_results_checked"] == 2 and out["h04/tool_results_altered"] == 1
    # the message is intact but the prompt tokens are not: cut between the message and the prompt
    first_tool = srcs.index(int(Source.TOOL))
    cut_ids = ids[: first_tool + 40] + [0] * (len(ids) - first_tool - 40)
    cut_src = srcs[: first_tool + 40] + [int(Source.PAD)] * (len(ids) - first_tool - 40)
    assert environment_integrity([good], by_id, CharTokenizer(), torch.tensor([cut_ids]), torch.tensor([cut_src]))[
        "h04/tool_results_altered"] == 1


def test_sampling_fit_recovers_a_sampler_temperature_and_not_a_context_change():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 12, 50, generator=g) * 3
    targets = torch.randint(0, 50, (4, 12), generator=g)
    mask = torch.ones(4, 12, dtype=torch.bool)
    cold = torch.log_softmax(logits / 0.7, -1).gather(-1, targets[..., None])[..., 0]
    fit = sampling_fit(logits, targets, cold, mask, temperature=1.0)
    assert fit["h06/fit_temperature_factor"] == 0.7 and fit["h06/fit_gap_best"] < 1e-5 < fit["h06/fit_gap_trainer"]
    other = torch.log_softmax(torch.randn(4, 12, 50, generator=g) * 3, -1).gather(-1, targets[..., None])[..., 0]
    fit = sampling_fit(logits, targets, other, mask, temperature=1.0)
    assert fit["h06/fit_gap_best"] > 0.2 * fit["h06/fit_gap_trainer"]


def test_logp_gap_splits_before_and_after_the_first_tool_result():
    src = torch.tensor([[Source.ASSISTANT] * 3 + [Source.TOOL] * 2 + [Source.ASSISTANT] * 3])
    s = torch.zeros(1, 8)
    t = torch.tensor([[0, 0, 0, 0, 0, -0.5, -0.5, -0.5]])
    out = logp_gap(s, t, torch.ones(1, 8), src)
    assert out["h06/logp_gap_pre_tool"] == 0 and abs(out["h06/logp_gap_post_tool"] - 0.5) < 1e-6


def test_a_gap_explained_by_sampling_settings_is_h06_and_one_that_is_not_stays_h02():
    gap = {"h06/logp_gap_mean": series(lambda s: 0.05)}
    fit = {"h06/fit_gap_trainer": [(0, 0.05)], "h06/fit_gap_best": [(0, 1e-6)],
           "h06/fit_temperature_factor": [(0, 0.7)], "h06/fit_top_p": [(0, 1.0)], "h06/fit_top_k": [(0, 0.0)]}
    diag = diagnose_metrics(with_({**gap, **fit}))
    assert diag.top_hypothesis == "h06" and diag[0].check == "sampling_settings_differ"
    unexplained = {**fit, "h06/fit_gap_best": [(0, 0.04)]}
    assert (diagnose_metrics(with_({**gap, **unexplained}))).top_hypothesis == "h02"


def test_audit_and_integrity_findings_name_h05_and_h04():
    assert (diagnose_metrics(with_({"h05/reward_audit_mismatch_share": series(lambda s: 0.5)}))).top_hypothesis == "h05"
    assert (diagnose_metrics(with_({"h04/tool_results_altered_share": series(lambda s: 1.0)}))).top_hypothesis == "h04"


def test_flat_run_with_nothing_flagged_says_cause_not_found_and_a_learning_run_stays_clean():
    flat = diagnose_metrics(with_({"reward": series(lambda s: 0.5 + 0.05 * ((-1) ** s))}))
    assert flat.top_hypothesis == "unexplained"
    assert flat[0].check == "flat_reward_cause_not_found" and "cause not found" in flat[0].verdict
    assert "Next:" in flat[0].verdict
    rising = diagnose_metrics(with_({"reward": series(lambda s: 0.4 + 0.02 * s + 0.03 * ((-1) ** s))}))
    assert rising.top_hypothesis == "clean"
    # a flagged instrument outranks and replaces the flat finding
    broken = diagnose_metrics(with_({"reward": series(lambda s: 0.5), "h01/amplification_max": series(lambda s: 3e6)}))
    assert broken.top_hypothesis == "h01" and not any(d.hypothesis == "unexplained" for d in broken)
    assert clean()  # the shared clean history has no reward series: nothing is said about a trend


def test_sampling_fit_grid_equals_the_per_setting_reference():
    from musique_rl.instruments.sync import _warped_logps

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 10, 40, generator=g) * 2
    targets = logits.argmax(-1)  # sampled tokens are usually likely ones: kept by every truncation
    mask = torch.ones(3, 10, dtype=torch.bool)
    sampler = _warped_logps(logits, targets, 0.8, 0.9, 0)
    fit = sampling_fit(logits, targets, sampler, mask, temperature=1.0)
    assert fit["h06/fit_temperature_factor"] == 0.8 and fit["h06/fit_top_p"] == 0.9
    assert fit["h06/fit_gap_best"] < 1e-5
    ref = float((_warped_logps(logits, targets, 1.0, 1.0, 0) - sampler).abs().mean())
    assert abs(fit["h06/fit_gap_trainer"] - ref) < 1e-5


def test_sampling_calibration_tells_true_draws_from_hotter_colder_and_wider_ones():
    """The sampled tokens themselves, not the recorded log-probs: draws of the claimed distribution give a
    z of a few at most; a hotter sampler (temperature 2 where 1 is recorded), a greedy one, or one that
    ignores the claimed top-k are far outside."""
    from musique_rl.instruments.sync import sampling_calibration

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 120, 200, generator=g) * 3
    mask = torch.ones(8, 120, dtype=torch.bool)

    def draw(temperature: float) -> torch.Tensor:
        probs = (logits / temperature).softmax(-1).view(-1, 200)
        return torch.multinomial(probs, 1, generator=g).view(8, 120)

    true = [sampling_calibration(logits, draw(1.0), mask, 1.0)["h06/sample_surprise_z"] for _ in range(5)]
    assert all(abs(z) < 4 for z in true), true
    hot = sampling_calibration(logits, draw(2.0), mask, 1.0)
    assert hot["h06/sample_surprise_z"] > 20 and hot["h06/sample_surprise_excess"] > 1.0
    greedy = sampling_calibration(logits, logits.argmax(-1), mask, 1.0)
    assert greedy["h06/sample_surprise_z"] < -20
    wider = sampling_calibration(logits, draw(1.0), mask, 1.0, top_k=5)
    assert wider["h06/sample_outside_share"] > 0.2
    # only the sampled positions count; none: no reading rather than a made-up one
    assert sampling_calibration(logits, draw(1.0), torch.zeros_like(mask), 1.0) == {}
    # a matching truncation is a true draw again
    z5 = logits.masked_fill(logits < logits.topk(5, -1).values[..., -1:], float("-inf"))
    top5 = torch.multinomial(z5.softmax(-1).view(-1, 200), 1, generator=g).view(8, 120)
    same = sampling_calibration(logits, top5, mask, 1.0, top_k=5)
    assert same["h06/sample_outside_share"] == 0 and abs(same["h06/sample_surprise_z"]) < 4


def test_tokens_drawn_hotter_than_recorded_are_a_sampling_cause_that_explains_the_budgets_they_fill():
    """No recorded log-prob gap (the sampler records the policy's log-probs), but its tokens are far too
    surprising for the policy's entropy: h06 samples_off_distribution is the cause, and the token budgets the
    rambling fills are its consequence; a true draw's z leaves the run clean."""
    budgets = {"h04/budget_cap_share": series(lambda s: 0.25), "h04/no_answer_share": series(lambda s: 0.45)}
    hot = {"h06/sample_surprise_z": [(0, 46.0)], "h06/sample_surprise_excess": [(0, 1.8)],
           "h06/sample_outside_share": [(0, 0.0)], "h06/sample_tokens": [(0, 356.0)]}
    diag = diagnose_metrics(with_({**budgets, **hot}))
    assert (diag.top_hypothesis, diag[0].check) == ("h06", "samples_off_distribution"), [f.check for f in diag if f.flagged]
    cap = diag.find("budgets_binding")
    assert cap is not None and cap.flagged and str(cap.role) == "consequence"
    fine = {**hot, "h06/sample_surprise_z": [(0, 0.7)], "h06/sample_surprise_excess": [(0, 0.002)]}
    assert not diagnose_metrics(with_(fine)).find("samples_off_distribution").flagged
    # a real but immaterial difference (a long probe makes a tiny excess significant) is not the defect
    tiny = {**hot, "h06/sample_surprise_z": [(0, 9.0)], "h06/sample_surprise_excess": [(0, 0.01)]}
    assert not diagnose_metrics(with_(tiny)).find("samples_off_distribution").flagged
