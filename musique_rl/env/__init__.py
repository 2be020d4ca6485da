"""The environment layer: what a question, a tool call and a reward are. It imports nothing above it.

data (MuSiQue records and dataset specs), synthetic (the embedded MuSiQue-schema generator),
retrieval (retrievers, one class each), tools (the retrieve_documents tool), parsing (the answer
tags), rewards (components and presets), prompts (chat messages), policies (scripted policies:
oracle, no_tool, replay, and the noisy oracle the warm start learns from), registry (named plug-ins).
"""
