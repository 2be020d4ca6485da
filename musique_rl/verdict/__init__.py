"""Verdicts: does a hypothesis' sweep move its predicted metric? Treatment minus control, paired by seed.

One module per job:
  stats.py     the decision rule: t-interval, sign-flip test, status, confidence (pure functions)
  design.py    is the comparison fair: config, warm start, code, machine
  judge.py     a sweep's runs -> the verdict as plain data (verdict.json)
  load.py      reading a sweep: MLflow runs or a Hydra multirun directory
  plots.py     the sweep's two pictures: reward curves per arm, paired differences
  budget.py    how long the runs were (steps x seeds) and whether that is enough ("too short to judge")
  publish.py   plots, verdict.json, status.md, the MLflow parent run; publishing into docs/STATUS.md
               (refused for a too short, dirty, mixed-machine or failed sweep) and the page's row check
  cli.py       python -m musique_rl.verdict --sweep <dir or id> | --experiment hNN | publish --sweep DIR | check

A sweep judges itself at its end: musique_rl/sweep/callback.py calls these steps in order.
"""

from musique_rl.verdict.cli import main, run_verdict
from musique_rl.verdict.design import code_notes, design_check
from musique_rl.verdict.judge import judge
from musique_rl.verdict.load import (
    TAG_ARM,
    TAG_HYPOTHESIS,
    TAG_MACHINE,
    TAG_PARENT,
    TAG_SEED,
    TAG_SWEEP,
    TAG_SWEEP_PARENT,
    TAG_WARM_START,
    apply_job_outcomes,
    load_hypothesis_file,
    load_mlflow,
    load_multirun,
    load_sweep,
)
from musique_rl.verdict.publish import (
    MARK_END,
    MARK_START,
    PublishRefused,
    attach,
    draw_plots,
    publish,
    publish_problems,
    publish_status,
    report,
    row_problems,
    status_file_problems,
    status_table,
    table_row,
    update_status_file,
    write,
)
from musique_rl.verdict.stats import decide, sign_flip_test, t_interval
from musique_rl.verdict.sweep import ARMS, HYPOTHESIS_DIR, STATUS, Hypothesis, Run, Sweep, VerdictError

__all__ = [
    "ARMS", "HYPOTHESIS_DIR", "Hypothesis", "MARK_END", "MARK_START", "PublishRefused", "Run", "STATUS", "Sweep",
    "TAG_ARM", "TAG_HYPOTHESIS", "TAG_MACHINE", "TAG_PARENT", "TAG_SEED", "TAG_SWEEP", "TAG_SWEEP_PARENT",
    "TAG_WARM_START", "VerdictError", "apply_job_outcomes", "attach", "code_notes", "decide", "design_check",
    "draw_plots", "judge", "load_hypothesis_file", "load_mlflow", "load_multirun", "load_sweep", "main", "publish",
    "publish_problems", "publish_status", "report", "row_problems", "run_verdict", "sign_flip_test",
    "status_file_problems", "status_table", "t_interval", "table_row", "update_status_file", "write",
]
