"""What is measured during a run: one pure module per instrument, the facade the trainer calls.

    batch            one generation batch as the instruments read it; the per-batch registry
    advantages       h01  group spread, std amplification, advantages vs rewards
    ledger           h02  where each token came from (Source) and what the loss/KL/attention covered
    kl               h03  the KL term per token kind and its sign
    truncation       h04  token budgets: episodes cut, tool results dropped, the question left out
    reward_signal    h05  reward components, errors, constant groups
    audit            h04/h05 the independent paths: tool results re-read, rewards re-scored
    scorer_overlap   h05  citation and retrieval scorers where they overlap
    sync, floor      h06  sampler/trainer gap, parity probe, sampling-settings fit; the dtype floor
    episodes         h07  episode shape: turns, tool calls, failures, void turns
    updates          h08  the optimizer step: update/weight ratio, Adam's step
    preflight             learnability forecast from the first batch
    loss_inputs           the point-of-use checks: what the loss multiplied, read from its gradient
    trajectory            the HTML token view of a few episodes
    suite            ``Instruments``: the one object the trainer calls (docs/architecture.md)
    trainer_callback ``InstrumentsCallback``: measures each optimizer step for ``observe_update``
    config           the ``diagnostics`` config group the instruments read

Every metric an instrument logs is a ``Metric`` declared in musique_rl/base/catalogue.py; the
doctor (musique_rl/doctor/) judges the histories they leave in ``metrics.jsonl``. The package imports
nothing itself: composing a config reads ``config`` alone, and must not wait for torch.
"""
