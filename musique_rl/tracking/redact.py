"""Redaction of credentials before anything is logged (MLflow params, tags, artifacts).

Three nets, because a secret can reach a config value in any shape: (1) keys that name a secret
(`hf_token`, `password`, `api_key`, ...) have their whole value replaced; (2) values that look like
a credential (hf_..., sk-..., ghp_..., AKIA..., JWTs, `user:password@` in a URI, `?token=`) are
masked in place; (3) the value of any environment variable whose NAME says it is a secret
(HF_TOKEN, *_API_KEY, *_PASSWORD, ...) is masked wherever it appears, whatever its shape.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

MASK = "***"
REDACTED = "<redacted>"

# (1) a key component naming a secret; word-bounded so `max_tokens_per_turn` is not one
_SECRET_KEY = re.compile(
    r"(^|[_.\-])(token|password|passwd|pwd|secret|credentials?|api_?key|access_?key|private_?key|auth)($|[_.\-])",
    re.IGNORECASE,
)
# (2) credential shapes in values
_PATTERNS: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"(?P<scheme>[A-Za-z][\w+.\-]*://)(?P<user>[^:/@\s]*):(?P<pw>[^@\s/]+)@"), r"\g<scheme>\g<user>:" + MASK + "@"),
    (re.compile(r"(?P<k>[?&;](?:access_?token|token|api_?key|apikey|key|password|passwd|secret|sig|signature)=)[^&\s#]+", re.I), r"\g<k>" + MASK),
    (re.compile(r"(?i)\b(bearer|basic)\s+[A-Za-z0-9._~+/\-]{8,}=*"), r"\1 " + MASK),
    (re.compile(r"\bhf_[A-Za-z0-9]{16,}"), MASK),  # Hugging Face
    (re.compile(r"\bsk-[A-Za-z0-9_\-]{16,}"), MASK),  # OpenAI / Anthropic style
    (re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,})"), MASK),  # GitHub
    (re.compile(r"\bglpat-[A-Za-z0-9_\-]{16,}"), MASK),  # GitLab
    (re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"), MASK),  # AWS access key id
    (re.compile(r"\bxox[abposr]-[A-Za-z0-9\-]{10,}"), MASK),  # Slack
    (re.compile(r"\beyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}"), MASK),  # JWT
]
# (3) environment variables whose name marks their value as a secret
_SECRET_ENV = re.compile(r"(TOKEN|PASSWORD|PASSWD|SECRET|API_KEY|APIKEY|ACCESS_KEY|PRIVATE_KEY|CREDENTIAL)", re.I)
_MIN_ENV_SECRET = 6  # shorter values ("1", "true") would mask innocent text
_HYDRA_ESCAPE = re.compile(r"\\([:=,\\ ()\[\]{}'\"])")  # Hydra's override escapes


def is_secret_key(key: str) -> bool:
    """True when the last component of a dotted key names a secret."""
    return bool(_SECRET_KEY.search(key.rsplit(".", 1)[-1]))


def _env_secrets() -> list[str]:
    # Another thread (MLflow's telemetry) may change os.environ while we read it: read key by key.
    for _ in range(5):
        try:
            names = [k for k in list(os.environ) if _SECRET_ENV.search(k)]
            break
        except RuntimeError:  # changed size during iteration
            continue
    else:
        names = []
    vals = {v for k in names if (v := os.environ.get(k)) and len(v) >= _MIN_ENV_SECRET}
    return sorted(vals, key=len, reverse=True)  # longest first: a secret containing another


def redact(text: Any) -> str:
    """`text` as a string with every credential-looking part masked.

    Hydra escapes `:` and `=` in override strings (`http\\://u\\:pw@h`); those backslashes are
    removed first so an escaped URI is recognised, and the result reads like the value the user typed.
    """
    s = _HYDRA_ESCAPE.sub(r"\1", str(text))
    for secret in _env_secrets():
        s = s.replace(secret, MASK)
    for pattern, repl in _PATTERNS:
        s = pattern.sub(repl, s)
    return s


def redact_value(key: str, value: Any) -> str:
    """A param/tag value: fully replaced when its key names a secret, else pattern-masked."""
    if is_secret_key(key) and value not in (None, "", "None", "null"):
        return REDACTED
    return redact(value)


def redact_tree(tree: Any, _key: str = "") -> Any:
    """A deep copy of a config container (dicts/lists) with secrets redacted, for artifacts."""
    if isinstance(tree, Mapping):
        return {k: redact_tree(v, f"{_key}.{k}" if _key else str(k)) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return [redact_tree(v, _key) for v in tree]
    if isinstance(tree, str):
        return redact_value(_key, tree)
    if tree is not None and is_secret_key(_key):
        return REDACTED
    return tree


# ---------------------------------------------------------------- files and logs the job does not write itself
_YAML_KEY = re.compile(r"^(?P<lead>\s*(?:-\s+)?)(?P<key>[\w.\-+~]+)(?P<sep>:\s+|=)(?P<value>.*)$")


def redact_yaml_text(text: str) -> str:
    """Hydra's saved configs (``.hydra/*.yaml``, ``multirun.yaml``) with every secret masked: a line
    holding a credential-shaped value, or a key (``key: v`` or an override ``- key=v``) that names a
    secret. Lines without a secret are kept byte for byte (their escapes and layout too), so the
    verdict and the case study read the same configs."""
    out = []
    for line in text.splitlines(keepends=True):
        body = line.rstrip("\r\n")
        m = _YAML_KEY.match(body)
        if m and is_secret_key(m["key"]) and m["value"].strip() not in ("", "null", "None", "''", '""'):
            body = f"{m['lead']}{m['key']}{m['sep']}{REDACTED}"
        else:
            masked = redact(body)
            if MASK in masked and MASK not in body:
                body = masked
        out.append(body + line[len(line.rstrip("\r\n")):])
    return "".join(out)


def redact_files(paths: Any) -> None:
    """Rewrite each existing file of ``paths`` through ``redact_yaml_text`` (only when it held a secret)."""
    from pathlib import Path

    for path in paths:
        p = Path(path)
        if not p.is_file():
            continue
        text = p.read_text(encoding="utf-8")
        clean = redact_yaml_text(text)
        if clean != text:
            tmp = p.with_name(p.name + ".tmp")
            tmp.write_text(clean, encoding="utf-8")
            os.replace(tmp, p)


class RedactingFilter:
    """A logging filter for handlers: the message and traceback of every record, redacted. On a
    handler it sees the records of every logger (MLflow's, urllib3's, ours), which a logger's own
    filter would not."""

    def filter(self, record: Any) -> bool:
        import logging

        try:
            message = record.getMessage()
        except Exception:
            return True
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
        return True


def redact_logs() -> None:
    """Put ``RedactingFilter`` on every handler of the root logger (Hydra's console and job file)."""
    import logging

    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())
