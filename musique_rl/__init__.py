"""musique_rl: find out why GRPO on multi-hop QA with retrieval tools stays flat, and make it learn."""

import os

# GPU images often carry JAX, and `datasets` imports it when present: XLA would then preallocate
# ~75% of GPU memory at import and leave torch ~17 GB of an 80 GB GPU. Set here, before anything
# of ours imports `datasets`; a value the user exported wins (e.g. =true for a JAX workload).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

__version__ = "0.1.0"
