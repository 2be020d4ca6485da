"""musique_rl: find out why GRPO on multi-hop QA with retrieval tools stays flat, and make it learn."""

__version__ = "0.1.0"
