"""Typed, strict run configuration: one YAML file per scenario, checked before anything starts.

    python -m train.config configs/ocr/smoke.yaml --set loader.num_workers=4

prints the fully resolved config, or exits 2 with one line that says what is wrong and the fix:

    config error: configs/ocr/smoke.yaml: loader.num_wokers: unknown key. Did you mean
    loader.num_workers?

Rules of the format
- The schema is the dataclasses below. Parsing walks their type hints, so a new knob is one line.
  Unknown keys, wrong types and out-of-range values are errors, never silently ignored.
- `extends: base.yaml` deep-merges a file over its base (chains allowed): mappings merge, lists
  and scalars replace. The extends path is relative to the file that contains it.
- `--set key.path=value` overrides are read as YAML values and checked exactly like file values.
- Dataset and dictionary paths (data.train, data.val, data.char_dict, data.skip_keys_file) are
  relative to the repository root, i.e. the working directory of `python -m train`, NOT to the
  YAML file, so one path means the same in every config. They are kept as written; `s3://` URLs
  are left alone.
- `${NAME}` and `${NAME:-default}` in a string value are replaced by the environment variable
  NAME (the default when it is unset or empty), as in compose files; `$${` is a literal `${`. The
  scenario files use this for the roots that differ between a checkout and a container:
  OCR_DATA_DIR, RESNET50_DATA_DIR, RUNS_ROOT and CACHE_ROOT, which the images set once (ENV in
  docker/*.Dockerfile), so every scenario file works in both places unchanged. The resolved
  config (config.resolved.yaml, `python -m train.config`) shows the values after substitution.
- Floats need a dot: PyYAML follows YAML 1.1 and reads `1e-3` as a string; write `1.0e-3`.
- Byte sizes take an int or a string such as 512m, 8g, 1.5GiB. Units are powers of 1024, as in
  Docker's --shm-size.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import difflib
import functools
import os
import re
import sys
import tempfile
import types
from collections.abc import Iterable
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml

RESOLVED_NAME = "config.resolved.yaml"
GIB = 1024**3


class ConfigError(ValueError):
    """A config problem, always shown as ONE line: `config error: <file>: <key>: <problem>. <hint>`.

    `source` is the file (or the --set item) that set the offending value; `key` its dotted path.
    """

    def __init__(self, key: str, problem: str, hint: str = "", source: str = ""):
        super().__init__(problem)
        self.key, self.problem, self.hint, self.source = key, problem, hint, source

    def __str__(self) -> str:
        parts = ["config error", *(part for part in (self.source, self.key) if part)]
        text = ": ".join([*parts, _sentence(self.problem)])
        if self.hint:
            text += " " + _sentence(self.hint[0].upper() + self.hint[1:])
        return re.sub(r"\s*\n\s*", " ", text)  # YAML messages carry newlines; logs want one line


class _WrongType(ConfigError):
    """The value has the wrong kind; a union catches this and tries its next member."""

    def __init__(self, key: str, expected: str, value: Any, hint: str = ""):
        super().__init__(key, f"expected {expected}, got {_show(value)}", hint)


def _sentence(text: str) -> str:
    return text if text.endswith((".", "?", "!")) else text + "."


def _show(value: Any) -> str:
    shown = repr(value)
    return (
        f"{shown[:60]}... ({type(value).__name__})"
        if len(shown) > 60
        else f"{shown} ({type(value).__name__})"
    )


@dataclass(frozen=True)
class Bounds:
    """Range check attached to a type with Annotated, e.g. Annotated[int, Bounds(low=1)]."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False  # True: value must be strictly greater than low
    hint: str = ""

    def describe(self) -> str:
        if self.low is not None and self.high is not None:
            return f"between {self.low} and {self.high}"
        if self.low is not None:
            return f"> {self.low}" if self.low_open else f">= {self.low}"
        return f"<= {self.high}"

    def check(self, value: float, key: str) -> None:
        too_low = self.low is not None and (
            value <= self.low if self.low_open else value < self.low
        )
        if too_low or (self.high is not None and value > self.high):
            raise ConfigError(key, f"must be {self.describe()}, got {value}", self.hint)


BYTES = "bytes"  # Annotated marker: the field also accepts size strings such as 512m or 8g
ByteSize = Annotated[int, BYTES]
PositiveInt = Annotated[int, Bounds(low=1)]
NonNegativeInt = Annotated[int, Bounds(low=0)]
PositiveFloat = Annotated[float, Bounds(low=0, low_open=True)]
NonNegativeFloat = Annotated[float, Bounds(low=0)]
Fraction = Annotated[float, Bounds(low=0, high=1)]
WorkerCount = Annotated[int, Bounds(low=0, hint="use 0 to load in the main process, or 'auto'")]


# ---------------------------------------------------------------- schema: one dataclass per section
@dataclass(frozen=True, kw_only=True)
class DataConfig:
    train: str  # local path (relative to the repository root) or s3:// URL
    val: str | None = None
    char_dict: str | None = None  # OCR: one character per line; required when task is ocr
    use_space_char: bool = False
    image_shape: list[PositiveInt] = field(default_factory=lambda: [3, 48, 320])  # OCR: C, H, W
    max_text_length: PositiveInt = 25  # OCR
    augment: bool = True
    image_size: PositiveInt = 224  # ResNet: random-resized crop for training
    eval_resize: PositiveInt = 256  # ResNet: resize the short side, then center-crop image_size
    cache: Literal["none", "memory", "disk"] = "none"  # shared by all workers, bounded below
    cache_dir: str = ".cache/data"
    cache_max_bytes: ByteSize = 2 * GIB
    max_bad_fraction: Fraction = 0.01  # abort when more samples than this fail to decode
    skip_keys_file: str | None = None  # keys to skip, one per line (e.g. an earlier run's)
    remote_cache_dir: str = ".cache/remote"  # where s3:// data is staged before reading
    remote_cache_max_bytes: ByteSize | None = None  # None: no limit


@dataclass(frozen=True, kw_only=True)
class LoaderConfig:
    batch_size: PositiveInt = 64  # per rank
    eval_batch_size: PositiveInt | None = None  # None: batch_size
    num_workers: WorkerCount | Literal["auto"] = "auto"  # see resolve_num_workers()
    prefetch_factor: PositiveInt | None = None  # batches in flight per worker; None: 2
    persistent_workers: bool = False  # keep workers (and their open files) across epochs
    pin_memory: bool = True  # torch: page-locked batches copy to the GPU asynchronously
    use_shared_memory: bool = True  # paddle: workers hand batches over through /dev/shm
    multiprocessing_context: Literal["fork", "spawn", "forkserver"] | None = None
    timeout_s: NonNegativeFloat = 120.0  # a worker silent this long is an error; 0: wait forever
    drop_last: bool = True

    def batching(self, train: bool) -> tuple[int, bool]:
        """(batch size, drop last) for a train or an evaluation loader: evaluation uses
        eval_batch_size when set and never drops the last partial batch (every validation
        sample counts)."""
        if train:
            return self.batch_size, self.drop_last
        return self.eval_batch_size or self.batch_size, False


@dataclass(frozen=True, kw_only=True)
class ShmConfig:
    policy: Literal["fail", "adapt"] = "fail"  # adapt: lower prefetch/workers until batches fit
    headroom: Annotated[float, Bounds(low=1, hint="it multiplies the estimated need")] = 1.5


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    name: Literal["crnn", "crnn_tiny", "resnet50", "resnet18"] | None = None  # None: by task
    hidden_size: PositiveInt = 256  # CRNN: BiLSTM width
    num_classes: PositiveInt | None = None  # ResNet; None: read from the dataset


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    name: Literal["sgd", "adam", "adamw"] = "adamw"
    lr: PositiveFloat = 1e-3
    momentum: Fraction = 0.9
    weight_decay: NonNegativeFloat = 1e-4
    warmup_steps: NonNegativeInt = 0
    schedule: Literal["cosine", "constant", "step"] = "cosine"
    grad_clip: PositiveFloat | None = None  # max global gradient norm


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    epochs: PositiveInt = 1  # the run stops after epochs or max_steps, whichever comes first
    max_steps: PositiveInt | None = None
    log_every: PositiveInt = 20
    eval_every: PositiveInt | None = None  # steps; None: once per epoch
    amp: Literal["none", "fp16", "bf16"] = "none"
    profile: bool = False
    device: Literal["auto", "cpu", "gpu"] = "auto"
    checkpoint_every: PositiveInt | None = None  # steps; None: at the end of each epoch
    keep_last: PositiveInt = 3
    stall_warn_fraction: Fraction = 0.3  # warn when steps wait on data longer than this share


@dataclass(frozen=True, kw_only=True)
class OutputConfig:
    dir: str = "runs/{task}-{framework}-{config_name}"  # config_name: the YAML file's stem


@dataclass(frozen=True, kw_only=True)
class Config:
    task: Literal["ocr", "resnet50"]
    framework: Literal["paddle", "torch"]
    seed: NonNegativeInt = 0
    deterministic: bool = False
    data: DataConfig
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    shm: ShmConfig = field(default_factory=ShmConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    output: OutputConfig = field(default_factory=OutputConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_MODELS_BY_TASK = {"ocr": ("crnn", "crnn_tiny"), "resnet50": ("resnet50", "resnet18")}
_REQUIRED_HINTS = {
    "task": "add 'task: ocr' or 'task: resnet50', or 'extends:' a base file that has it",
    "framework": "add 'framework: paddle' or 'framework: torch'",
    "data.train": "set it to a dataset path (relative to the repository root) or an s3:// URL",
}


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
        return float(value)
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
    result = _parse_size(value, key) if BYTES in extras else _parse(value, base, key)
    for extra in extras:
        if isinstance(extra, Bounds):
            extra.check(result, key)
    return result


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
        if name not in fields:
            raise _unknown_key(str(name), key, list(fields))
    hints = _type_hints(cls)
    kwargs = {}
    for name, spec in fields.items():
        child_key = f"{key}.{name}" if key else name
        if name in value:
            kwargs[name] = _parse(value[name], hints[name], child_key)
        elif dataclasses.is_dataclass(hints[name]):  # so errors name the missing inner key
            kwargs[name] = _parse({}, hints[name], child_key)
        elif spec.default is MISSING and spec.default_factory is MISSING:
            raise ConfigError(
                child_key, "required key is missing", _REQUIRED_HINTS.get(child_key, "")
            )
    return cls(**kwargs)


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
    paths = []
    for name, hint in _type_hints(cls).items():
        path = f"{prefix}{name}"
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
    """Check what depends on the task; return the model name (defaulted by task)."""
    models = _MODELS_BY_TASK[config.task]
    model_name = config.model.name or models[0]
    if model_name not in models:
        hint = f"use one of: {', '.join(models)}"
        raise ConfigError(
            "model.name", f"'{model_name}' is not a model for task {config.task}", hint
        )
    data = config.data
    if config.task == "ocr" and not data.char_dict:
        hint = "point it at the character list, one character per line"
        raise ConfigError("data.char_dict", "required when task is ocr", hint)
    if config.task == "ocr" and len(data.image_shape) != 3:
        got = f"{len(data.image_shape)} numbers"
        raise ConfigError(
            "data.image_shape", f"expected 3 numbers [C, H, W], got {got}", "e.g. [3, 48, 320]"
        )
    if config.task == "resnet50" and data.eval_resize < data.image_size:
        problem = f"{data.eval_resize} is smaller than data.image_size ({data.image_size})"
        raise ConfigError("data.eval_resize", problem, "eval resizes, then center-crops image_size")
    if not data.train.strip():
        raise ConfigError("data.train", "is empty", _REQUIRED_HINTS["data.train"])
    for name in ("train", "val", "char_dict", "skip_keys_file"):
        path = getattr(data, name)
        if path and re.match(r"[A-Za-z][\w+.-]*://", path) and not path.startswith("s3://"):
            hint = "stage the data to a local path, or use s3://"
            raise ConfigError(f"data.{name}", f"unsupported URL scheme in {path!r}", hint)
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


# ---------------------------------------------------------------- files, extends and --set
def _display(path: Path) -> str:
    """Path as the user would type it: relative to the working directory when inside it."""
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _read_yaml(path: Path) -> dict:
    label = _display(path)
    try:
        text = path.read_text(encoding="utf-8")
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
            f"the top level must be a mapping (task:, framework:, data:, ...), got {_show(data)}"
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
        raise ConfigError("extends", f"expected a file path, got {_show(base_ref)}", source=label)
    base_path = (path.parent / base_ref).resolve()  # an absolute base_ref stays absolute
    if base_path in (*chain, path):
        loop = [*chain, path][[*chain, path].index(base_path) :] + [base_path]
        cycle = " -> ".join(_display(p) for p in loop)
        raise ConfigError("extends", f"cycle {cycle}", "remove one of these extends", label)
    if not base_path.is_file():
        hint = "extends paths are relative to the file that contains them"
        raise ConfigError("extends", f"file not found: {_display(base_path)}", hint, label)
    base, origins = _read_with_extends(base_path, (*chain, path))
    return _deep_merge(base, data, label, origins, ""), origins


def _deep_merge(base: dict, override: dict, label: str, origins: dict, prefix: str) -> dict:
    merged = dict(base)
    for name, value in override.items():
        key = f"{prefix}{name}"
        if isinstance(value, dict) and isinstance(merged.get(name), dict):
            merged[name] = _deep_merge(merged[name], value, label, origins, key + ".")
        else:  # lists and scalars replace
            merged[name] = value
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
    return _validate(copy.deepcopy(data), name, overrides, origins={}, default_source=name)


def _validate(
    data: dict, name: str, overrides: Iterable[str], origins: dict, default_source: str
) -> Config:
    for item in overrides:
        _apply_override(data, item, origins)
    try:
        data = _expand_env(data, "", dict(os.environ))
        return _finish(_parse_section(data, Config, ""), name)
    except ConfigError as error:  # blame the file (or --set) that set the offending key
        error.source = error.source or _origin(error.key, origins, default_source)
        raise


def load_config(path: str | os.PathLike, overrides: Iterable[str] = ()) -> Config:
    """Read a scenario YAML (following extends), apply --set overrides, validate everything."""
    path = Path(path)
    if not path.is_file():
        hint = "scenario files live in configs/ocr/ and configs/resnet50/"
        raise ConfigError("", "file not found", hint, source=str(path))
    data, origins = _read_with_extends(path.resolve(), ())
    return _validate(data, path.stem, overrides, origins, default_source=_display(path))


def _escape_dollars(value: Any) -> Any:
    if isinstance(value, dict):
        return {name: _escape_dollars(child) for name, child in value.items()}
    if isinstance(value, list):
        return [_escape_dollars(item) for item in value]
    return value.replace("${", "$${") if isinstance(value, str) else value


def save_resolved(config: Config, run_dir: str | os.PathLike) -> Path:
    """Write run_dir/config.resolved.yaml atomically, so a crash never leaves half a file."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    text = "# Every value this run used. Check: python -m train.config <this file>\n"
    # Values are stored after ${NAME} substitution; a literal "${" that remains (written $${) is
    # escaped again so that loading this file gives the same config.
    text += yaml.safe_dump(_escape_dollars(config.to_dict()), sort_keys=False)
    handle, temp_path = tempfile.mkstemp(dir=run_dir, prefix=".config.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as stream:
            stream.write(text)
        os.chmod(temp_path, 0o644)
        os.replace(temp_path, run_dir / RESOLVED_NAME)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp_path)
        raise
    return run_dir / RESOLVED_NAME


def resolve_num_workers(
    value: int | str, cpu_count: int | None = None, local_world_size: int = 1
) -> tuple[int, str]:
    """Turn loader.num_workers into a count, with the reason to log.

    'auto' follows the rule of thumb min(8, 0.75 x cores): leave a quarter of the cores to the
    main process (and the GPU driver), and stop at 8, past which workers rarely help one GPU.
    With several ranks on one node, each rank gets its share of the cores.
    """
    if value != "auto":
        return int(value), f"set in config: {value}"
    cores = cpu_count if cpu_count is not None else usable_cores()
    ranks = max(1, local_world_size)
    workers = min(8, max(1, int(0.75 * cores / ranks)))
    share = f"{cores} cores" if ranks == 1 else f"{cores} cores / {ranks} ranks"
    return workers, f"auto: min(8, 0.75 x {share}) = {workers}"


def usable_cores() -> int:
    """CPUs this process may run on: its affinity mask, capped by a cgroup CPU quota if any."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no sched_getaffinity
        cores = os.cpu_count() or 1
    try:  # containers and Kubernetes limit CPU by quota, which the affinity mask does not show
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, round(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cores


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m train.config", description="Check a config and print it fully resolved."
    )
    parser.add_argument("config", help="scenario YAML, e.g. configs/ocr/smoke.yaml")
    add_overrides_argument(parser)
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as error:
        print(error, file=sys.stderr)
        return 2
    sys.stdout.write(yaml.safe_dump(config.to_dict(), sort_keys=False))
    workers, reason = resolve_num_workers(config.loader.num_workers)
    print(f"# loader.num_workers on this machine: {workers} ({reason})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
