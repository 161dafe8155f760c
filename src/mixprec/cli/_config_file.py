"""``--config FILE``: a subcommand's flags from a TOML or YAML file; flags typed on the command line win.

Keys are the flag names, with dashes or underscores (``seq-len = 128`` or ``seq_len = 128``), flat (no
tables). Values go through the same type check as the flag (``batch-size = "8"`` and ``batch-size = 8``
both work, ``batch-size = 2.5`` is refused), so a file can express exactly what the command line can.
Unknown keys are an error naming them and listing the valid ones: a typo must not silently train with a
default.

"The command line wins" needs to know which flags were *typed*, not which merely hold their default
(``--batch-size 16`` must beat ``batch-size = 32`` even though 16 is the default). argparse does not record
that, so :func:`track_explicit` swaps in store actions that note their ``dest`` in the namespace.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from mixprec.cli.main import CliError

_EXPLICIT = "_explicit_flags"
_PARSER = "_config_parser"
# dests that are never config keys: the file cannot name itself, and the dispatcher's own fields
_NOT_KEYS = frozenset({"help", "config", "func", "command", _EXPLICIT, _PARSER})


def _recording(base: type[argparse.Action]) -> type[argparse.Action]:
    class Recording(base):  # type: ignore[misc, valid-type]
        def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001
            super().__call__(parser, namespace, values, option_string)
            vars(namespace).setdefault(_EXPLICIT, set()).add(self.dest)

    Recording.__name__ = f"Recording{base.__name__}"
    return Recording


# argparse's store actions are private classes, but their names have been stable since Python 3.2 and
# `parser.register("action", ...)` is the documented hook for replacing them.
_ACTIONS = {
    None: _recording(argparse._StoreAction),
    "store": _recording(argparse._StoreAction),
    "store_true": _recording(argparse._StoreTrueAction),
    "store_false": _recording(argparse._StoreFalseAction),
    "store_const": _recording(argparse._StoreConstAction),
}


def track_explicit(parser: argparse.ArgumentParser) -> None:
    """Make the arguments added to ``parser`` from now on record that they were typed. Idempotent."""
    for name, cls in _ACTIONS.items():
        parser.register("action", name, cls)


def explicit_flags(args: argparse.Namespace) -> set[str]:
    """The ``dest`` names of the flags typed on the command line (needs :func:`track_explicit`)."""
    return set(getattr(args, _EXPLICIT, set()))


def add_config_arg(parser: argparse.ArgumentParser) -> None:
    """Add ``--config FILE`` to ``parser`` and start tracking typed flags. Call it before adding other flags;
    then call :func:`apply_config` on the parsed namespace."""
    track_explicit(parser)
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="read flags from a TOML or YAML file (keys = flag names); flags on the command line override it",
    )
    parser.set_defaults(**{_PARSER: parser})


def _tomllib(path: Path) -> Any:
    try:
        import tomllib  # Python >= 3.11
    except ModuleNotFoundError:
        try:
            import tomli as tomllib  # the same parser, packaged for Python 3.10
        except ModuleNotFoundError:
            raise CliError(f"--config {path}: reading TOML on Python 3.10 needs tomli (pip install tomli)") from None
    return tomllib


def load_config_file(path: str | Path) -> dict[str, Any]:
    """The file's top-level table as a dict (TOML via tomllib, YAML via pyyaml when installed)."""
    p = Path(path)
    if p.is_dir():
        raise CliError(f"--config {p}: a folder, not a file; pass the path of a .toml or .yaml file")
    if not p.is_file():
        raise FileNotFoundError(f"--config: no such file: {p}")
    suffix = p.suffix.lower()
    if suffix == ".toml":
        tomllib = _tomllib(p)
        try:
            data = tomllib.loads(p.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise CliError(f"--config {p}: not valid TOML ({exc})") from None
    elif suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ModuleNotFoundError:
            raise CliError(
                f"--config {p}: reading YAML needs pyyaml (pip install pyyaml), or use a .toml file"
            ) from None
        try:
            data = yaml.safe_load(p.read_text(encoding="utf-8"))
        except (yaml.YAMLError, UnicodeDecodeError) as exc:
            detail = " ".join(str(exc).split())
            raise CliError(f"--config {p}: not valid YAML ({detail})") from None
        data = {} if data is None else data  # an empty YAML file is an empty mapping
    else:
        raise CliError(f"--config {p}: unknown format {suffix or '(no extension)'!r}; use a .toml, .yaml or .yml file")
    if not isinstance(data, dict):
        raise CliError(f"--config {p}: the top level must be a table of flag = value, got {type(data).__name__}")
    return data


def _key_to_action(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    keys: dict[str, argparse.Action] = {}
    for action in parser._actions:  # the parser's arguments; no public accessor exists
        if action.dest in _NOT_KEYS or not action.option_strings:
            continue
        for opt in action.option_strings:
            if opt.startswith("--"):
                keys[opt[2:].replace("-", "_")] = action
        keys[action.dest] = action
    return keys


def _convert(path: Path, key: str, action: argparse.Action, value: Any) -> Any:
    where = f"--config {path}: {key}"
    if action.nargs == 0:  # store_true / store_false: the file states the flag's value, not its presence
        if not isinstance(value, bool):
            raise CliError(f"{where} must be true or false, got {value!r}")
        return value if isinstance(action, argparse._StoreTrueAction) else not value
    if value is None:
        if action.default is not None:
            raise CliError(f"{where} cannot be empty (null)")
        return None
    if isinstance(value, (list, dict)):
        raise CliError(f"{where} must be a single value, got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise CliError(f"{where} must be finite, got {value!r}")
    # the flag's own type function on the text, so a file and the command line accept exactly the same
    # values (and 2.5 for an integer flag is refused rather than truncated)
    text = str(value).lower() if isinstance(value, bool) else str(value)
    converted: Any = text
    if action.type is not None:
        try:
            converted = action.type(text)
        except (argparse.ArgumentTypeError, TypeError, ValueError) as exc:
            raise CliError(f"{where}: invalid value {value!r} ({exc})") from None
    if action.choices is not None and converted not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise CliError(f"{where}: invalid choice {value!r} (choose from {choices})")
    return converted


def apply_config(args: argparse.Namespace) -> dict[str, Any]:
    """Fill ``args`` from ``args.config`` (if set) for every flag not typed on the command line.

    Returns the values taken from the file (by ``dest``). Raises :class:`CliError` naming unknown keys or a
    bad value, FileNotFoundError for a missing file.
    """
    path = getattr(args, "config", None)
    if path is None:
        return {}
    return apply_config_file(args, path, keep=explicit_flags(args))


def apply_config_file(
    args: argparse.Namespace, path: str | Path, keep: set[str] | frozenset[str] = frozenset()
) -> dict[str, Any]:
    """Set ``args`` from the config file ``path``, except the dests in ``keep``; returns what the file set.

    Every key is checked (unknown keys, bad values) even when ``keep`` means its value is not used.
    """
    parser: argparse.ArgumentParser = getattr(args, _PARSER)
    data = load_config_file(path)
    actions = _key_to_action(parser)
    unknown = sorted(k for k in data if str(k).replace("-", "_") not in actions)
    if unknown:
        valid = sorted({a.option_strings[-1][2:] for a in actions.values()})
        raise CliError(
            f"--config {path}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
            f"valid keys: {', '.join(valid)}"
        )
    taken: dict[str, Any] = {}
    for key, value in data.items():
        action = actions[str(key).replace("-", "_")]
        converted = _convert(Path(path), str(key), action, value)
        if action.dest in taken:
            raise CliError(f"--config {path}: {key!r} sets {action.dest} a second time")
        taken[action.dest] = converted
        if action.dest not in keep:
            setattr(args, action.dest, converted)
    return taken


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)  # a float's repr is TOML's spelling too: 0.001, 1e-05, inf, -inf, nan
    # a JSON string is a valid TOML basic string (same escapes)
    return json.dumps(str(value), ensure_ascii=False)


def dump_toml(values: dict[str, Any], header: str = "") -> str:
    """A flat TOML document of ``values`` (flag names with dashes; None values left out, as TOML has no null),
    readable back with ``--config``."""
    lines = [f"# {line}" for line in header.splitlines()]
    for key, value in values.items():
        if value is not None:
            lines.append(f"{key.replace('_', '-')} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"
