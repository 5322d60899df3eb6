"""``--config FILE.toml``: a command's settings kept in a file (a server's, typically), one table per
command named as the command and one key per flag (``max_batch = 4`` under ``[serve]`` for
``--max-batch 4``). Precedence: built-in defaults < the file < the command line. Every value goes
through the flag's own parsing, so a bad one is refused as the flag would refuse it, naming the file."""

from __future__ import annotations

import argparse
import contextlib
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from splitspec.deploy.args import CliError

_NOT_SETTINGS = {"help", "config", "debug", "func", "command"}


def _settings(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.dest not in _NOT_SETTINGS and a.option_strings}


def _value(path: str, command: str, key: str, action: argparse.Action, value: Any) -> Any:
    where = f"{path}: [{command}] {key}"
    if isinstance(action, argparse._StoreConstAction):  # store_true / store_false
        if not isinstance(value, bool):
            raise CliError(f"{where} must be true or false, got {value!r}")
        return value
    try:
        value = action.type(str(value)) if action.type is not None else value
    except (argparse.ArgumentTypeError, ValueError, TypeError) as e:
        raise CliError(f"{where}: {e}") from e
    if action.choices is not None and value not in action.choices:
        raise CliError(f"{where} must be one of {', '.join(map(str, action.choices))}, got {value!r}")
    return value


def file_defaults(path: str, command: str, parser: argparse.ArgumentParser, commands: set[str]) -> dict[str, Any]:
    """The ``[command]`` table of ``path`` as flag defaults for ``parser`` (that command's); other commands'
    tables may sit in the same file, anything else is refused."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except OSError as e:
        raise CliError(f"--config {path}: cannot read it ({e.strerror})") from e
    except tomllib.TOMLDecodeError as e:
        raise CliError(f"--config {path}: not valid TOML ({e})") from e
    if stray := sorted(set(data) - commands):
        raise CliError(f"{path}: unknown table(s) {', '.join(stray)}; tables are named after commands")
    table, known = data.get(command, {}), _settings(parser)
    if not isinstance(table, dict):
        raise CliError(f"{path}: [{command}] must be a table of settings")
    out = {}
    for key, value in table.items():
        action = known.get(key.replace("-", "_"))
        if action is None:
            raise CliError(f"{path}: [{command}] has no setting {key!r}; settings: {', '.join(sorted(known))}")
        out[action.dest] = _value(path, command, key, action, value)
    return out


def _commands(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def _required(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for sub in _commands(parser).choices.values() for a in sub._actions if a.required and a.option_strings]


@contextlib.contextmanager
def _optional(actions: list[argparse.Action]) -> Iterator[None]:
    for action in actions:
        action.required = False
    try:
        yield
    finally:
        for action in actions:
            action.required = True


def parse_leniently(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``argv`` parsed with no flag required: the command, ``--config`` and ``--debug``, which say how the
    real parse (``parse_with_config``) is made and how its errors are told."""
    with _optional(_required(parser)):
        return parser.parse_args(argv)


def parse_with_config(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse ``argv``; with ``--config``, over the file's defaults for the command, so that a required flag
    (``--converted``) may come from the file."""
    args = parse_leniently(parser, argv)
    if getattr(args, "config", None) is None:
        return parser.parse_args(argv)
    subparsers = _commands(parser)
    sub = subparsers.choices[args.command]
    defaults = file_defaults(args.config, args.command, sub, set(subparsers.choices))
    sub.set_defaults(**defaults)
    with _optional([a for a in _required(parser) if a.dest in defaults]):
        return parser.parse_args(argv)
