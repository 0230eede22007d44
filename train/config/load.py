"""Loading: YAML files with extends:, --set overrides, ${NAME:-default} substitution, the file
(or --set) to blame for an error, and the resolved config a run writes."""

from __future__ import annotations

import argparse
import contextlib
import copy
import logging
import os
import re
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from train import tasks
from train.config.errors import ConfigError, show
from train.config.schema import Config
from train.config.validate import check

log = logging.getLogger(__name__)

RESOLVED_NAME = "config.resolved.yaml"
# What a config may expand to: nodes counted with every alias expanded (each *name counts its
# anchor's whole subtree again, as every walk of the loaded mapping sees it), and nesting depth.
# Scenario files hold a few hundred nodes, a few levels deep; a "billion laughs" of 1 kB (nine
# anchors, each a list of nine aliases of the one before) expands to 10**9 nodes.
MAX_YAML_NODES = 100_000
MAX_YAML_DEPTH = 100


# ---------------------------------------------------------------- files, extends and --set
def _display(path: Path) -> str:
    """Path as the user would type it: relative to the working directory when inside it."""
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _check_expansion(text: str, source: str) -> None:
    """Raise ConfigError if ``text`` (YAML) expands, aliases followed, to more than
    MAX_YAML_NODES nodes or MAX_YAML_DEPTH levels, or holds an alias inside its own anchor.

    Walks the parser's events, which the parser makes without recursion and without building
    anything, and keeps one size per anchor: linear in the text however much it would expand.
    Composing or loading first would not do: the composer recurses once per level (a few kB of
    '[' are a RecursionError), the loaded mapping shares each anchor's subtree but every walk of
    it (the duplicate-key check, ${NAME} substitution, the merge of extends:) does not, and a
    recursive alias makes that walk endless."""
    hint = "write the values out; anchors and aliases may not expand to more than this"
    sizes: dict[str, tuple[int, int]] = {}  # anchor -> (nodes, depth) with aliases expanded
    open_: list[list] = []  # the collections being parsed: [anchor, nodes so far, depth below]
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.CollectionStartEvent):
            open_.append([event.anchor, 1, 0])
            if len(open_) > MAX_YAML_DEPTH:
                line = event.start_mark.line + 1
                problem = f"nested deeper than {MAX_YAML_DEPTH} levels (line {line})"
                raise ConfigError("", problem, "flatten the structure", source)
            continue
        if isinstance(event, yaml.CollectionEndEvent):
            anchor, nodes, below = open_.pop()
            depth = below + 1
            if anchor is not None:
                sizes[anchor] = (nodes, depth)
        elif isinstance(event, yaml.AliasEvent):
            if any(frame[0] == event.anchor for frame in open_):
                line = event.start_mark.line + 1
                problem = f"recursive alias *{event.anchor} (line {line}) inside its own anchor"
                raise ConfigError("", problem, "an alias may only repeat a finished value", source)
            nodes, depth = sizes.get(event.anchor, (1, 0))  # undefined: the composer says so
        elif isinstance(event, yaml.ScalarEvent):
            nodes, depth = 1, 0
            if event.anchor is not None:
                sizes[event.anchor] = (1, 0)
        else:  # stream and document events
            continue
        if not open_:
            continue
        if len(open_) + depth > MAX_YAML_DEPTH:
            line = event.start_mark.line + 1
            problem = f"nested deeper than {MAX_YAML_DEPTH} levels with its aliases expanded "
            raise ConfigError("", problem + f"(line {line})", hint, source)
        frame = open_[-1]
        frame[1] += nodes
        frame[2] = max(frame[2], depth)
        if frame[1] > MAX_YAML_NODES:
            line = event.start_mark.line + 1
            problem = (
                f"expands to more than {MAX_YAML_NODES} values with its aliases followed "
                f"(line {line}): an alias bomb"
            )
            raise ConfigError("", problem, hint, source)


def _read_yaml(path: Path) -> dict:
    label = _display(path)
    try:
        text = path.read_text(encoding="utf-8")
        _check_expansion(text, label)
        _reject_duplicate_keys(yaml.compose(text, Loader=yaml.SafeLoader), label)
        data = yaml.safe_load(text)
    except OSError as error:
        raise ConfigError("", f"cannot read file: {error.strerror}", source=label) from None
    except UnicodeDecodeError as error:
        raise ConfigError("", f"not UTF-8 text ({error.reason})", source=label) from None
    except yaml.YAMLError as error:
        mark, problem = getattr(error, "problem_mark", None), getattr(error, "problem", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        hint = "check the indentation and the ': ' after each key"
        raise ConfigError("", f"invalid YAML{where}: {problem or error}", hint, label) from None
    if data is None:
        raise ConfigError(
            "", "file is empty", "start it with 'extends: base.yaml' or 'task:'", label
        )
    if not isinstance(data, dict):
        problem = (
            f"the top level must be a mapping (task:, framework:, data:, ...), got {show(data)}"
        )
        raise ConfigError("", problem, source=label)
    return data


def _reject_duplicate_keys(node: Any, label: str, key: str = "") -> None:
    """YAML keeps the last of two equal keys; a strict config says so instead."""
    if isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _reject_duplicate_keys(item, label, key)
    if not isinstance(node, yaml.MappingNode):
        return
    seen = set()
    for key_node, value_node in node.value:
        name = key_node.value if isinstance(key_node, yaml.ScalarNode) else str(key_node.value)
        child_key = f"{key}.{name}" if key else name
        if name in seen:
            problem = f"duplicate key (line {key_node.start_mark.line + 1})"
            raise ConfigError(child_key, problem, "YAML keeps only the last one; merge them", label)
        seen.add(name)
        _reject_duplicate_keys(value_node, label, child_key)


def _read_with_extends(path: Path, chain: tuple[Path, ...]) -> tuple[dict, dict[str, str]]:
    """Return the merged mapping and, for each key path, the file that set it."""
    label, data = _display(path), _read_yaml(path)
    base_ref = data.pop("extends", None)
    origins: dict[str, str] = {}
    if base_ref is None:
        _record_origins(data, "", label, origins)
        return data, origins
    if not isinstance(base_ref, str) or not base_ref.strip():
        raise ConfigError("extends", f"expected a file path, got {show(base_ref)}", source=label)
    base_path = (path.parent / base_ref).resolve()  # an absolute base_ref stays absolute
    from_cwd = Path(base_ref).resolve()
    if not base_path.is_file() and from_cwd.is_file():
        # Not beside the file: from the working directory (the repository root, as the data
        # paths are). A file written outside configs/ names its scenario this way and works in
        # every layout: train.tune's tuned.yaml under runs/, in a checkout and in a container,
        # where runs/ is mounted elsewhere.
        base_path = from_cwd
    if base_path in (*chain, path):
        loop = [*chain, path][[*chain, path].index(base_path) :] + [base_path]
        cycle = " -> ".join(_display(p) for p in loop)
        raise ConfigError("extends", f"cycle {cycle}", "remove one of these extends", label)
    if not base_path.is_file():
        hint = (
            "extends paths are relative to the file that contains them (or the working directory)"
        )
        raise ConfigError("extends", f"file not found: {_display(base_path)}", hint, label)
    base, origins = _read_with_extends(base_path, (*chain, path))
    return deep_merge(base, data, label, origins), origins


def deep_merge(
    base: dict, override: dict, label: str = "", origins: dict | None = None, prefix: str = ""
) -> dict:
    """``override`` over ``base``, as ``extends:`` merges a file over its base: mappings merge
    key by key, lists and scalars replace. With ``origins``, each replaced key is recorded
    there as coming from ``label``."""
    merged = dict(base)
    for name, value in override.items():
        key = f"{prefix}{name}"
        if isinstance(value, dict) and isinstance(merged.get(name), dict):
            merged[name] = deep_merge(merged[name], value, label, origins, key + ".")
        else:  # lists and scalars replace
            merged[name] = value
            if origins is not None:
                _record_origins(value, key, label, origins)
    return merged


def _record_origins(value: Any, key: str, label: str, origins: dict[str, str]) -> None:
    if key:
        origins[key] = label
    if isinstance(value, dict):
        for name, child in value.items():
            _record_origins(child, f"{key}.{name}" if key else str(name), label, origins)


def _origin(key: str, origins: dict[str, str], default: str) -> str:
    """The file (or --set) that set `key` or its nearest enclosing section."""
    while key:
        if key in origins:
            return origins[key]
        key = key[: max(key.rfind("."), key.rfind("["), 0)]
    return default


def _apply_override(data: dict, item: str, origins: dict[str, str]) -> None:
    source = f"--set {item}"
    key, has_equals, text = item.partition("=")
    key = key.strip()
    if not has_equals or not key:
        raise ConfigError("", "expected KEY=VALUE", "e.g. --set loader.num_workers=4", source)
    try:
        _check_expansion(text, source)
        value = yaml.safe_load(text)
    except yaml.YAMLError:  # not valid YAML on its own (e.g. 'a: b: c'): take it as a string
        value = text
    node, parts = data, key.split(".")
    for depth, part in enumerate(parts[:-1]):
        section_key = ".".join(parts[: depth + 1])
        if node.get(part) is None:
            node[part] = {}
            origins[section_key] = source  # so an unknown section is blamed on this --set
        elif not isinstance(node[part], dict):
            raise ConfigError(section_key, "is a value, not a section", source=source)
        node = node[part]
    node[parts[-1]] = value
    _record_origins(value, key, source, origins)


# ---------------------------------------------------------------- ${NAME:-default} substitution
_ENV_REFERENCE = re.compile(r"\$\$\{|\$\{([^}]*)\}")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Names of variables that hold secrets (AWS_SECRET_ACCESS_KEY, HF_TOKEN, DB_PASSWORD, ...): their
# values are never substituted, because the resolved config is written to the run directory and
# printed by `python -m train.config`. Matched as words of the name (the parts between
# underscores), and the unambiguous ones anywhere in it (SECRETKEY, DBPASSWORD).
_SECRET_WORDS = frozenset(
    {"KEY", "KEYS", "TOKEN", "TOKENS", "SECRET", "SECRETS", "PASSWORD", "PASSWD", "CREDENTIALS"}
)
_SECRET_PARTS = ("SECRET", "PASSWORD", "PASSWD", "CREDENTIAL")


def looks_secret(name: str) -> bool:
    """Whether environment variable ``name`` looks like it holds a secret."""
    upper = name.upper()
    return bool(set(upper.split("_")) & _SECRET_WORDS) or any(p in upper for p in _SECRET_PARTS)


def _expand_env(value: Any, key: str, environ: dict[str, str]) -> Any:
    """Return `value` with ${NAME} / ${NAME:-default} replaced in every string inside it."""
    if isinstance(value, dict):
        return {
            name: _expand_env(child, f"{key}.{name}" if key else str(name), environ)
            for name, child in value.items()
        }
    if isinstance(value, list):
        return [_expand_env(item, f"{key}[{i}]", environ) for i, item in enumerate(value)]
    if not isinstance(value, str) or "$" not in value:
        return value

    def substitute(match: re.Match) -> str:
        if match[1] is None:  # $${ escapes a literal ${
            return "${"
        name, has_default, default = match[1].partition(":-")
        if not _ENV_NAME.fullmatch(name):
            hint = "write ${NAME} or ${NAME:-default}, NAME made of letters, digits and _"
            raise ConfigError(key, f"bad variable reference ${{{match[1]}}}", hint)
        if looks_secret(name):
            raise ConfigError(
                key,
                f"${{{name}}} looks like a secret (KEY, SECRET, TOKEN, PASSWORD or CREDENTIAL in "
                "its name): secrets are never substituted, since the resolved config is saved "
                "with the run and printed",
                "leave credentials in the environment where their reader takes them (AWS_* for "
                "s3:// data), not in the config",
            )
        if environ.get(name):
            return environ[name]
        if has_default:
            return default
        hint = f"export {name}=..., or give a default: ${{{name}:-value}}"
        raise ConfigError(key, f"environment variable {name} is not set", hint)

    return _ENV_REFERENCE.sub(substitute, value)


# ---------------------------------------------------------------- public API
def config_from_dict(data: dict, name: str = "inline", overrides: Iterable[str] = ()) -> Config:
    """Validate a mapping already in memory (tests, notebooks); `name` fills {config_name}."""
    return _resolve(copy.deepcopy(data), name, overrides, origins={}, default_source=name)


def _resolve(
    data: dict, name: str, overrides: Iterable[str], origins: dict, default_source: str
) -> Config:
    for item in overrides:
        _apply_override(data, item, origins)
    _rename_task(data)
    try:
        data = _expand_env(data, "", dict(os.environ))
        return check(data, name)
    except ConfigError as error:  # blame the file (or --set) that set the offending key
        error.source = error.source or _origin(error.key, origins, default_source)
        raise


_WARNED_RENAMES: set[str] = set()  # old task names already warned about in this process


def _rename_task(data: dict) -> None:
    """An old task name (train/tasks.py's RENAMED) reads as its new one, with a one-line
    warning once per process."""
    old = data.get("task")
    if not isinstance(old, str) or old not in tasks.RENAMED:
        return
    new = tasks.RENAMED[old]
    data["task"] = new
    if old not in _WARNED_RENAMES:
        _WARNED_RENAMES.add(old)
        log.warning(
            "task: %s is deprecated, read as task: %s; write task: %s in the config", old, new, new
        )


def load_config(path: str | os.PathLike, overrides: Iterable[str] = ()) -> Config:
    """Read a scenario YAML (following extends), apply --set overrides, validate everything."""
    path = Path(path)
    if not path.is_file():
        folders = dict.fromkeys(f"{each.scenario_dir}/" for each in tasks.TASKS.values())
        hint = f"scenario files live in {' and '.join(folders)}"
        raise ConfigError("", "file not found", hint, source=str(path))
    data, origins = _read_with_extends(path.resolve(), ())
    return _resolve(data, path.stem, overrides, origins, default_source=_display(path))


def _escape_dollars(value: Any) -> Any:
    if isinstance(value, dict):
        return {name: _escape_dollars(child) for name, child in value.items()}
    if isinstance(value, list):
        return [_escape_dollars(item) for item in value]
    return value.replace("${", "$${") if isinstance(value, str) else value


def save_resolved(config: Config, run_dir: str | os.PathLike) -> Path:
    """Write run_dir/config.resolved.yaml atomically, so a crash never leaves half a file. A
    link at that name is refused (the rename would replace it, not follow it), as at every name
    the run writes."""
    from datasets.safe_files import refuse_link

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    refuse_link(run_dir / RESOLVED_NAME)
    text = "# Every value this run used. Check: python -m train.config <this file>\n"
    # Values are stored after ${NAME} substitution; a literal "${" that remains (written $${) is
    # escaped again so that loading this file gives the same config.
    text += yaml.safe_dump(_escape_dollars(config.to_dict()), sort_keys=False)
    handle, temp_path = tempfile.mkstemp(dir=run_dir, prefix=".config.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as stream:
            stream.write(text)
        # Owner-only, as mkstemp made it: a config can name private buckets and hosts.
        os.chmod(temp_path, 0o600)
        os.replace(temp_path, run_dir / RESOLVED_NAME)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp_path)
        raise
    return run_dir / RESOLVED_NAME


def overrides_mapping(overrides: Iterable[str]) -> dict:
    """``--set KEY=VALUE`` items as the nested mapping a YAML file would hold (a file that
    ``extends:`` the scenario and holds this mapping loads as the scenario with the overrides)."""
    data: dict = {}
    for item in overrides:
        _apply_override(data, item, {})
    return data


def add_overrides_argument(parser: argparse.ArgumentParser) -> None:
    """``--set KEY=VALUE`` (repeatable) into ``args.overrides``, as :func:`load_config` takes."""
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set loader.num_workers=4 (repeatable)",
    )
