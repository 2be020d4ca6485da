"""musique_rl: find out why GRPO on multi-hop QA with retrieval tools stays flat, and make it learn."""

import os

# The environment defaults third-party libraries read at their import: the one place they are set.
# GPU images often carry JAX, and `datasets` imports it when present: XLA would then preallocate
# ~75% of GPU memory at import and leave torch ~17 GB of an 80 GB GPU. Set here, before anything
# of ours imports `datasets`; a value the user exported wins (e.g. =true for a JAX workload).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# rollout_func is TRL-experimental, and TRL warns on each use; we pin TRL (musique_rl/core/trainer.py).
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
# Metrics reach MLflow through musique_rl.tracking (report_to="none"), never through transformers'
# MLflow integration; without this TRL imports mlflow wherever it is installed (trl/extras/profiling.py),
# also with tracking.enabled=false. Here, because it must be set before anything imports TRL.
os.environ.setdefault("DISABLE_MLFLOW_INTEGRATION", "TRUE")

__version__ = "0.1.0"
