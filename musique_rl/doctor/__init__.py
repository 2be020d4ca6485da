"""What is judged from a run's metric histories: the doctor, reasoning along the GRPO step.

    python -m musique_rl.doctor --run-dir outputs/<date>/<time>      # diagnosis.json beside metrics.jsonl

    sources       where logs live (run dir, trainer_state.json, CSV/JSONL, MLflow) -> histories + params
    findings      a finding and the rule declaration (@rule: stage, checks and kinds, reads, thresholds)
    stages/       the rules, one module per stage of the step
    trl_rules     what the rules over TRL's own metric names share
    context       expectations from the run's own context; the claims they withdraw
    reward_power, trend   the flat-reward finding and the reward's trend
    chain         the stages in order; causes and the consequences each explains
    diagnose      rules -> withdrawals -> chain -> the ranked diagnosis (diagnosis.json)
    report        the text a user reads, the run tags, the triage table of many runs
    bounds        the single-value bounds the live console names while a run goes
    __main__      the command line

The metrics it reads are the ``Metric`` declarations of musique_rl/base/catalogue.py.
"""
