"""The environment layer: what a question, a tool call and a reward are. It imports nothing above it.

tasks (one module per task: its records, prompt, tools, reward check, oracle and warm start),
tool_formats (one module per tool-call syntax), answer_formats (where a
model writes its reasoning: tags, or its own thinking block), data (MuSiQue records and dataset specs),
synthetic and arith (the embedded generators), retrieval (retrievers, one class each), tools
(the retrieve_documents tool: checking and running calls), parsing (the answer tags), rewards
(components and presets), prompts (chat messages, asked of the task), policies (scripted
policies: oracle, no_tool, replay), registry (named plug-ins).
"""
