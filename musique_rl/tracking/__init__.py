"""MLflow tracking of jobs, nothing secret ever logged. One module per concern:

- ``store``: where runs live (``tracking.tracking_uri`` / ``$MLFLOW_TRACKING_URI`` / a sqlite file in
  the launch dir), the experiment, the reachability probe, ``TrackingUnavailable``;
- ``provenance``: what a run's figures depend on, as params and tags (config, git commit, config
  identity, sweep, machine, warm start);
- ``sink``: a job's run lifecycle (``open_run``: open or adopt, close FINISHED / FAILED / KILLED)
  and the guarded ``Tracker`` that ``musique_rl.job.app.run`` passes down to the job;
- ``upload``: send a run dir's metrics.jsonl to its run (``python -m musique_rl.tracking --upload <run dir>``);
- ``plots``: reward curves from a run dir's metrics.jsonl;
- ``sweep``: a multirun's parent run (opened once before fan-out, found by its jobs, closed at the end);
  the sweep's Hydra callback that drives it is musique_rl/sweep/callback.py.
"""
