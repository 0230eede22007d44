"""Validation: a parsed YAML mapping checked against the schema's type hints, then the checks
across fields. Every problem is one ConfigError naming the dotted key."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
import types
from dataclasses import MISSING
from typing import Annotated, Any, Literal, Union, get_args, get_origin, get_type_hints

from train import tasks
from train.config.errors import ConfigError, show
from train.config.schema import (
    BYTES,
    INFINITY,
    Bounds,
    ByteSize,
    Config,
    DataConfig,
    required_hint,
)


class _WrongType(ConfigError):
    """The value has the wrong kind; a union catches this and tries its next member."""

    def __init__(self, key: str, expected: str, value: Any, hint: str = ""):
        super().__init__(key, f"expected {expected}, got {show(value)}", hint)


class _NotFinite(ConfigError):
    """NaN or an infinity for a float field. Not a _WrongType: a union does not try its next
    member, since the value was meant as a number. ``text`` is the value as written."""

    def __init__(self, key: str, text: str, expected: str = "a finite number", default=None):
        hint = f"give {expected}" + ("" if default is None else f", e.g. the default {default}")
        hint += (
            "; NaN passes every range check (each comparison with it is false)"
            if "nan" in text.lower()
            else "; an infinity is no value this key can use"
        )
        super().__init__(key, f"is {text}, not a finite number", hint)
        self.text, self.expected = text, expected


# ---------------------------------------------------------------- generic parsing over type hints
def _parse(value: Any, hint: Any, key: str) -> Any:
    """Return `value` checked against the type `hint`; errors name the dotted `key`."""
    origin = get_origin(hint)
    if origin is Annotated:
        return _parse_annotated(value, hint, key)
    if origin in (Union, types.UnionType):
        return _parse_union(value, get_args(hint), key)
    if origin is Literal:
        return _parse_choice(value, get_args(hint), key)
    if origin is list:
        if not isinstance(value, list):
            raise _WrongType(key, _describe(hint), value, _null_hint(value))
        (item_hint,) = get_args(hint)
        return [_parse(item, item_hint, f"{key}[{i}]") for i, item in enumerate(value)]
    if dataclasses.is_dataclass(hint):
        return _parse_section(value, hint, key)
    return _parse_scalar(value, hint, key)


def _parse_scalar(value: Any, kind: type, key: str) -> Any:
    if kind in (bool, int, str) and type(value) is kind:  # type(), not isinstance: True is no int
        return value
    if kind is float and type(value) in (int, float):
        if not math.isfinite(value):  # YAML's .nan, .inf and -.inf, or a float past 1.8e308
            raise _NotFinite(key, repr(value))
        return float(value)
    if kind is float and isinstance(value, str) and _NOT_FINITE_TEXT.fullmatch(value.strip()):
        raise _NotFinite(key, value.strip())  # nan, inf, ... (YAML 1.1 reads them as strings)
    hint = _null_hint(value)
    if isinstance(value, bool) and kind in (int, float):
        hint = "a bool (true/false) is not a number"
    elif isinstance(value, str) and kind is int and re.fullmatch(r"[-+]?\d+", value.strip()):
        hint = f"write {value.strip()} without quotes"
    elif isinstance(value, str) and kind is float and _FLOAT_TEXT.fullmatch(value.strip()):
        number = value.strip()
        fixed = re.sub(r"^([-+]?\d+)([eE])", r"\1.0\2", number)
        hint = f"write {number} without quotes"
        if fixed != number:
            hint = f"write it as {fixed}: PyYAML reads a float without a dot as a string"
    raise _WrongType(key, _describe(kind), value, hint)


_FLOAT_TEXT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
_NOT_FINITE_TEXT = re.compile(r"[-+]?\.?(nan|inf|infinity)", re.IGNORECASE)


def _null_hint(value: Any) -> str:
    return "give a value, or delete the key to get the default" if value is None else ""


def _parse_union(value: Any, members: tuple, key: str) -> Any:
    allowed = [member for member in members if member is not type(None)]
    if value is None and len(allowed) < len(members):
        return None
    hints = []
    for member in allowed:
        try:
            return _parse(value, member, key)
        except _WrongType as error:  # range errors propagate: the kind was right
            hints.append(error.hint)
    raise _WrongType(key, _describe_union(members), value, next((h for h in hints if h), ""))


def _parse_choice(value: Any, choices: tuple, key: str) -> Any:
    if isinstance(value, str) and value in choices:
        return value
    hint = _null_hint(value)
    if isinstance(value, bool):
        hint = "YAML reads yes/no/on/off as true/false; quote the value"
    elif isinstance(value, str):
        close = difflib.get_close_matches(value, [str(c) for c in choices], n=1)
        hint = f"did you mean '{close[0]}'?" if close else ""
    raise _WrongType(key, _describe(Literal[choices]), value, hint)


def _parse_annotated(value: Any, hint: Any, key: str) -> Any:
    base, *extras = get_args(hint)
    if INFINITY in extras and _is_infinity(value):
        # The field documents what an infinity means; its bounds still apply. float() reads
        # inf and infinity, not YAML's dotted spelling as text ('.inf', quoted).
        result = float(value.replace(".", "")) if isinstance(value, str) else value
    else:
        try:
            result = _parse_size(value, key) if BYTES in extras else _parse(value, base, key)
        except _NotFinite as error:  # say which finite numbers the field takes
            raise _NotFinite(key, error.text, _describe(hint)) from None
    for extra in extras:
        if isinstance(extra, Bounds):
            extra.check(result, key)
    return result


def _is_infinity(value: Any) -> bool:
    if isinstance(value, str):
        return bool(_NOT_FINITE_TEXT.fullmatch(value.strip())) and "nan" not in value.lower()
    return type(value) is float and math.isinf(value)


_SIZE_TEXT = re.compile(r"(\d+(?:\.\d+)?)\s*(?:([kmgt])(?:i?b)?|b)?", re.IGNORECASE)
_SIZE_UNITS = {"k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}


def _parse_size(value: Any, key: str) -> int:
    if type(value) is int and value >= 0:
        return value
    match = _SIZE_TEXT.fullmatch(value.strip()) if isinstance(value, str) else None
    if match is None:
        raise _WrongType(key, _describe(ByteSize), value, "e.g. 536870912, 512m, 8g or 1.5GiB")
    return int(float(match[1]) * _SIZE_UNITS.get((match[2] or "").lower(), 1))


def _parse_section(value: Any, cls: type, key: str) -> Any:
    if value is None:  # a section header whose lines are all commented out
        value = {}
    if not isinstance(value, dict):
        raise _WrongType(key, "a mapping of keys (a section)", value)
    fields = {spec.name: spec for spec in dataclasses.fields(cls)}
    for name in value:
        if name not in fields and issubclass(cls, DataConfig) and name in _task_data_defaults():
            owners = [each.name for each in tasks.TASKS.values() if name in _data_keys(each)]
            tasks_word = "tasks" if len(owners) > 1 else "task"
            problem = f"is a data key of {tasks_word} {' and '.join(owners)}, not of this task"
            raise ConfigError(f"{key}.{name}", problem, f"remove it, or set task: {owners[0]}")
        if name not in fields:
            raise _unknown_key(str(name), key, list(fields))
    hints = _type_hints(cls)
    kwargs = {}
    for name, spec in fields.items():
        child_key = f"{key}.{name}" if key else name
        hint = hints[name]
        if cls is Config and name == "data":  # the task's own data section (task comes first)
            hint = tasks.get(kwargs["task"]).data
            value = {**value, name: _without_other_tasks_defaults(value.get(name), hint)}
        if name in value:
            try:
                kwargs[name] = _parse(value[name], hint, child_key)
            except _NotFinite as error:
                if error.key != child_key or spec.default in (MISSING, None):
                    raise
                raise _NotFinite(child_key, error.text, error.expected, spec.default) from None
        elif dataclasses.is_dataclass(hint):  # so errors name the missing inner key
            kwargs[name] = _parse({}, hint, child_key)
        elif spec.default is MISSING and spec.default_factory is MISSING:
            raise ConfigError(child_key, "required key is missing", required_hint(child_key))
    return cls(**kwargs)


def _without_other_tasks_defaults(data: Any, block: type) -> Any:
    """``data`` without the keys of other tasks' data sections that hold those sections'
    defaults: every data key once lived in one section, and a config written then (a run's
    config.resolved.yaml) holds them all. Set to anything else, such a key is an unknown key."""
    if not isinstance(data, dict):
        return data
    own = {spec.name for spec in dataclasses.fields(block)}
    defaults = _task_data_defaults()
    return {
        name: value
        for name, value in data.items()
        if name in own or name not in defaults or value not in defaults[name]
    }


def _data_keys(task) -> set[str]:
    return {spec.name for spec in dataclasses.fields(task.data)}


@functools.cache
def _task_data_defaults() -> dict[str, list]:
    """Each task's own data key (beyond DataConfig's) -> its defaults in the sections that
    have it."""
    common = {spec.name for spec in dataclasses.fields(DataConfig)}
    found: dict[str, list] = {}
    for each in tasks.TASKS.values():
        for spec in dataclasses.fields(each.data):
            if spec.name in common:
                continue
            if spec.default is not MISSING:
                found.setdefault(spec.name, []).append(spec.default)
            elif spec.default_factory is not MISSING:
                found.setdefault(spec.name, []).append(spec.default_factory())
    return found


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls, include_extras=True)


def _unknown_key(name: str, section: str, valid: list[str]) -> ConfigError:
    key = f"{section}.{name}" if section else name
    elsewhere = [path for path in _field_paths(Config) if path.rsplit(".", 1)[-1] == name]
    if elsewhere:
        hint = f"Did you mean {elsewhere[0]}?"
    else:
        candidates = valid + ([] if section else ["extends"])
        close = difflib.get_close_matches(name, candidates, n=1)
        prefix = f"{section}." if section else ""
        hint = f"Did you mean {prefix}{close[0]}?" if close else f"Valid keys: {', '.join(valid)}"
    return ConfigError(key, "unknown key", hint)


def _field_paths(cls: type, prefix: str = "") -> list[str]:
    """Every key's dotted path; data: every task's data keys."""
    paths = []
    for name, hint in _type_hints(cls).items():
        path = f"{prefix}{name}"
        if hint is DataConfig:
            blocks = dict.fromkeys(each.data for each in tasks.TASKS.values())
            keys = dict.fromkeys(p for block in blocks for p in _field_paths(block, path + "."))
            paths.extend(keys)
            continue
        nested = dataclasses.is_dataclass(hint)
        paths.extend(_field_paths(hint, path + ".") if nested else [path])
    return paths


def _describe(hint: Any) -> str:
    origin, args = get_origin(hint), get_args(hint)
    if origin is Annotated:
        if BYTES in args[1:]:
            return "a size (bytes, or a string like 512m, 8g, 1.5GiB)"
        bounds = [extra.describe() for extra in args[1:] if isinstance(extra, Bounds)]
        return " ".join([_describe(args[0]), *bounds])
    if origin in (Union, types.UnionType):
        return _describe_union(args)
    if origin is Literal:
        return ("one of " if len(args) > 1 else "") + ", ".join(repr(arg) for arg in args)
    if origin is list:
        return f"a list of {_describe(args[0])}"
    names = {bool: "true or false", int: "int", float: "a number", str: "a string"}
    return names.get(hint, getattr(hint, "__name__", str(hint)))


def _describe_union(members: tuple) -> str:
    return " or ".join("null" if arg is type(None) else _describe(arg) for arg in members)


# ---------------------------------------------------------------- checks across fields
def _check_task(config: Config) -> str:
    """Check what depends on the task (its models, its own checks in train/tasks.py); return
    the model name (defaulted by task)."""
    task = tasks.get(config.task)
    model_name = config.model.name or task.model_names[0]
    if model_name not in task.model_names:
        hint = f"use one of: {', '.join(task.model_names)}"
        raise ConfigError(
            "model.name", f"'{model_name}' is not a model for task {config.task}", hint
        )
    data = config.data
    for key, problem, hint in task.problems(data):
        raise ConfigError(key, problem, hint)
    model_problems = task.model(model_name).problems
    for key, problem, hint in model_problems(data) if model_problems else ():
        raise ConfigError(key, problem, hint)
    if not data.train.strip():
        raise ConfigError("data.train", "is empty", required_hint("data.train"))
    for name in ("train", "val", "skip_keys_file", *task.input_files):
        path = getattr(data, name)
        if path and re.match(r"[A-Za-z][\w+.-]*://", path) and not path.startswith("s3://"):
            hint = "stage the data to a local path, or use s3://"
            raise ConfigError(f"data.{name}", f"unsupported URL scheme in {path!r}", hint)
    if config.model.init_from is not None:
        from train.weights import source_problem

        found = source_problem(config.model.init_from)
        if found:
            raise ConfigError("model.init_from", *found)
    return model_name


def _check_loader_and_steps(config: Config) -> None:
    loader = config.loader
    if loader.num_workers == 0 and loader.prefetch_factor is not None:
        problem = f"is {loader.prefetch_factor} but loader.num_workers is 0, so nothing prefetches"
        hint = "remove loader.prefetch_factor (or set it to null), or set loader.num_workers > 0"
        raise ConfigError("loader.prefetch_factor", problem, hint)
    if loader.num_workers == 0 and loader.persistent_workers:
        problem = "is true but loader.num_workers is 0, so there are no workers to keep"
        hint = "set loader.persistent_workers: false, or set loader.num_workers > 0"
        raise ConfigError("loader.persistent_workers", problem, hint)
    max_steps, warmup = config.train.max_steps, config.optim.warmup_steps
    if max_steps is not None and warmup >= max_steps:
        problem = (
            f"{warmup} is not below train.max_steps ({max_steps}): the run would end in warmup"
        )
        raise ConfigError("optim.warmup_steps", problem, "lower warmup_steps or raise max_steps")


def _finish(config: Config, config_name: str) -> Config:
    """Cross-field checks, then fill the values derived from other fields."""
    model_name = _check_task(config)
    _check_loader_and_steps(config)
    template = config.output.dir
    try:
        out_dir = template.format(
            task=config.task, framework=config.framework, config_name=config_name
        )
    except (KeyError, IndexError, ValueError) as error:
        hint = "use only {task}, {framework} and {config_name}"
        raise ConfigError("output.dir", f"bad placeholder {error} in {template!r}", hint) from None
    return dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, name=model_name),
        output=dataclasses.replace(config.output, dir=out_dir),
    )


def check(data: dict, config_name: str) -> Config:
    """The Config that ``data`` (the mapping after extends, --set and ${NAME} substitution)
    describes, or the first ConfigError; ``config_name`` fills {config_name} in output.dir."""
    return _finish(_parse_section(data, Config, ""), config_name)
