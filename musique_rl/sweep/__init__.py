"""A Hydra multirun's own work, before its jobs and after them.

  callback.py  SweepCallback: the MLflow parent run, then (after the jobs) the jobs table, the
               verdict, its plots and the parent's outcome, in that order
  jobs.py      the jobs table: <sweep dir>/jobs.json, the one record of each job's outcome

Nothing is imported here, so ``musique_rl.sweep.jobs`` (read by the launchers and the verdict)
loads without the callback and what it imports.
"""
