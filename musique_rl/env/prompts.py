"""What the policy sees at the start of an episode: the messages and the tool schemas, as the run's
task (``env.task``, musique_rl/env/tasks/) writes them. The rollout, the trainer and the warm start
ask here, so none of them needs to know which task runs.
"""

from __future__ import annotations

from musique_rl.env.answer_formats import answer_format as _answer_format
from musique_rl.env.config import EnvConfig
from musique_rl.env.tasks import task_for


def tool_schemas(env_cfg: EnvConfig) -> list[dict]:
    """OpenAI function schemas offered to the model (none when the task offers no tool)."""
    return task_for(env_cfg).tool_schemas(env_cfg)


def build_messages(record: dict, env_cfg: EnvConfig, answer_format: str = "tags") -> list[dict]:
    """System + user messages for one record, asking for the reply in ``answer_format``
    (``model.answer_format``: musique_rl/env/answer_formats.py)."""
    return _answer_format(answer_format).prompt(task_for(env_cfg).messages(record, env_cfg))
