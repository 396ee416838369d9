"""docs/deploy.md's "Configuration" table, rendered from ``app.settings.Settings``.

``python -m tests.deploy.settings_table`` prints the table to paste into docs/deploy.md;
tests/deploy/test_readme.py checks that docs/deploy.md lists exactly these variables, defaults and descriptions.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from pathlib import Path

from pydantic.fields import FieldInfo

from app.settings import Settings

# Meanings for fields that carry no description in app/settings.py.
FALLBACK = {
    "host": "address to listen on (`127.0.0.1`: this machine only)",
    "port": "TCP port to listen on",
    "log_level": "log level of the JSON logs on stderr",
}


@dataclass(frozen=True)
class Row:
    variable: str
    default: str
    meaning: str


def env_name(field: str) -> str:
    prefix = str(Settings.model_config.get("env_prefix", ""))
    return f"{prefix}{field}".upper()


def default_text(info: FieldInfo) -> str:
    value = info.get_default(call_default_factory=True)
    if isinstance(value, list):
        return ", ".join(value) if value else "(empty)"
    if isinstance(value, Path):
        return f"`{value.as_posix()}`"
    return f"`{value}`"


def choices(info: FieldInfo) -> list[str]:
    annotation = info.annotation
    if typing.get_origin(annotation) is typing.Literal:
        return [str(a) for a in typing.get_args(annotation)]
    return []


def meaning(name: str, info: FieldInfo) -> str:
    text = info.description or FALLBACK.get(name, "")
    if options := choices(info):
        text += "; one of " + ", ".join(f"`{o}`" for o in options)
    return text


def rows() -> list[Row]:
    return [Row(env_name(n), default_text(i), meaning(n, i)) for n, i in Settings.model_fields.items()]


def render() -> str:
    lines = ["| Variable | Default | Meaning |", "| --- | --- | --- |"]
    lines += [f"| `{r.variable}` | {r.default} | {r.meaning} |" for r in rows()]
    return "\n".join(lines)


if __name__ == "__main__":
    print(render())
