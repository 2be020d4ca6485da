"""The RL core: models, generation, token-exact multi-turn rollouts, the GRPO trainer, warm starts.

Imports the environment and base layers only; the instruments, the doctor and the experiment layer sit
above it and hand it what it needs (the instruments, through instrumentation.Instrumentation; callbacks). faults declares the planted
defects, one module each, and the hooks the rollout and trainer call; devices the process, GPU and port rules.
"""
