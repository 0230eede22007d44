"""Tests for the strict config loader (train/config/) and the scenario YAMLs.

python3 -m pytest tests/test_config.py -q
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from train import tasks
from train.config.errors import ConfigError
from train.config.load import RESOLVED_NAME, config_from_dict, load_config, save_resolved
from train.config.schema import Config
from train.cpus import resolve_num_workers
from train.tasks import TASKS

REPO_ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = sorted((REPO_ROOT / "configs").glob("*/*.yaml"))
BAD_CONFIGS_DIR = REPO_ROOT / "tests" / "fixtures" / "bad_configs"
BAD_CONFIGS = sorted(BAD_CONFIGS_DIR.glob("*.yaml"))
MINIMAL = {"task": "classification", "framework": "torch", "data": {"train": "data/x.h5"}}
# The roots the scenario files read as ${NAME:-default}, as the images set them (ENV in
# docker/*.Dockerfile); unset, the defaults are the checkout's layout.
IMAGE_ROOTS = {
    "OCR_DATA_DIR": "/data/ocr",
    "RESNET50_DATA_DIR": "/data/resnet50",
    "RUNS_ROOT": "/runs",
    "CACHE_ROOT": "/cache",
}
# The data roots of the images (a scenario reads its data under one of them); in a checkout,
# data lies under data/.
IMAGE_DATA_ROOTS = tuple(f"{IMAGE_ROOTS[name]}/" for name in ("OCR_DATA_DIR", "RESNET50_DATA_DIR"))

# fixture file -> a substring its one-line error must contain
EXPECTED_ERRORS = {
    "bad_enum_typo.yaml": "optim.schedule: expected one of 'cosine', 'constant', 'step', got",
    "bad_list_item.yaml": "data.image_shape[1]: must be >= 1, got 0",
    "bad_literal.yaml": "data.cache: expected one of 'none', 'memory', 'disk', got 'ram'",
    "bad_output_placeholder.yaml": "output.dir: bad placeholder 'date'",
    "bad_size_string.yaml": "data.cache_max_bytes: expected a size",
    "batch_size_zero.yaml": "loader.batch_size: must be >= 1, got 0",
    "bool_for_int.yaml": "loader.batch_size: expected int, got True (bool)",
    "duplicate_key.yaml": "loader: duplicate key (line 7)",
    "empty.yaml": "file is empty",
    "error_in_base.yaml": "error_in_base.yaml: loader.workers: unknown key",
    # the error is in the base, so the base file is named, not the child
    "error_in_base_child.yaml": "error_in_base.yaml: loader.workers: unknown key",
    "eval_resize_below_crop.yaml": "data.eval_resize: 200 is smaller than data.image_size (224)",
    "extends_cycle_a.yaml": "extends: cycle",
    "extends_cycle_b.yaml": "extends: cycle",
    "extends_missing_file.yaml": "extends: file not found",
    "extends_not_a_path.yaml": "extends: expected a file path",
    "float_without_dot.yaml": "optim.lr: expected a number, got '1e-3' (str). Write it as 1.0e-3",
    "image_shape_wrong_length.yaml": "data.image_shape: expected 3 numbers",
    "invalid_syntax.yaml": "invalid YAML at line 5",
    "key_in_wrong_section.yaml": "train.batch_size: unknown key. Did you mean loader.batch_size?",
    "lr_nan.yaml": "optim.lr: is nan, not a finite number. Give a number > 0, e.g. the default",
    "lr_zero.yaml": "optim.lr: must be > 0",
    "max_bad_fraction_above_one.yaml": "data.max_bad_fraction: must be between 0 and 1",
    "max_bad_fraction_nan.yaml": "data.max_bad_fraction: is nan, not a finite number",
    "missing_data_train.yaml": "data.train: required key is missing",
    "missing_task.yaml": "task: required key is missing",
    "model_task_mismatch.yaml": "model.name: 'resnet18' is not a model for task ocr",
    "negative_workers.yaml": "loader.num_workers: must be >= 0, got -2",
    "not_a_mapping.yaml": "the top level must be a mapping",
    "null_for_int.yaml": "loader.batch_size: expected int, got None",
    "ocr_height_not_reducible.yaml": "data.image_shape: the CRNN reduces the height 16-fold",
    "ocr_label_longer_than_time_steps.yaml": "data.max_text_length: 25 characters need at least 25",
    "ocr_without_char_dict.yaml": "data.char_dict: required when task is ocr",
    "only_comment.yaml": "file is empty",
    "persistent_without_workers.yaml": "loader.persistent_workers: is true but loader.num_workers",
    "prefetch_without_workers.yaml": "Remove loader.prefetch_factor (or set it to null), or set",
    "section_not_a_mapping.yaml": "loader: expected a mapping of keys (a section), got 8 (int)",
    "string_for_int.yaml": "loader.batch_size: expected int, got '8' (str). Write 8 without quotes",
    "timeout_infinite.yaml": "loader.timeout_s: is inf, not a finite number. Give a number >= 0",
    "typo_with_suggestion.yaml": "loader.num_wokers: unknown key. Did you mean loader.num_workers?",
    "unknown_nested_key.yaml": "loader.shuffle_buffer: unknown key",
    "unknown_top_key.yaml": "optimizer: unknown key. Did you mean optim?",
    "unsupported_url.yaml": "data.train: unsupported URL scheme",
    "warmup_past_max_steps.yaml": "optim.warmup_steps: 500 is not below train.max_steps (100)",
    "workers_not_a_number.yaml": "loader.num_workers: expected int >= 0 or 'auto', got 'eight'",
    "yaml_bool_for_choice.yaml": "train.amp: expected one of 'none', 'fp16', 'bf16', got False",
}


@pytest.fixture(autouse=True)
def checkout_layout(monkeypatch):
    """Every test starts with the checkout's layout, also inside the images (docker/smoke.sh runs
    this file there, where ENV sets the roots); tests that want the roots set them."""
    for name in IMAGE_ROOTS:
        monkeypatch.delenv(name, raising=False)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "train.config", *args]
    return subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)


# ---------------------------------------------------------------- the scenario files
def test_every_scenario_folder_has_the_standard_scenarios():
    expected = {"base", "smoke", "single_gpu", "multi_gpu", "small_dataset"}
    expected.add("remote_storage")
    for task in TASKS.values():  # every task of train/tasks.py
        names = {path.stem for path in (REPO_ROOT / task.scenario_dir).glob("*.yaml")}
        assert expected <= names, f"{task.scenario_dir} lacks {sorted(expected - names)}"


def _without_weights(path: Path) -> list[str]:
    """A scenario that fine-tunes (model.init_from) names weights a fresh clone has not made yet
    (scripts/convert_weights.py); tests/test_ppocrv4.py loads those with the weights made."""
    return ["model.init_from=null"] if "init_from:" in path.read_text() else []


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_scenario_config_loads(path: Path):
    # dataset paths need not exist: the loader never opens them
    config = load_config(path, _without_weights(path))
    assert tasks.get(config.task).scenario_dir == f"configs/{path.parent.name}"
    assert config.model.name is not None, "model.name is filled from the task"
    assert "{" not in config.output.dir and config.output.dir.endswith(path.stem)


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_resolved_config_round_trips(path: Path, tmp_path: Path):
    config = load_config(path, _without_weights(path))
    written = save_resolved(config, tmp_path / "run")
    assert written == tmp_path / "run" / RESOLVED_NAME
    assert [p.name for p in written.parent.iterdir()] == [RESOLVED_NAME], "no temp file left"
    assert load_config(written) == config


def test_scenarios_set_what_their_names_promise():
    ocr_smoke = load_config(REPO_ROOT / "configs/ocr/smoke.yaml")
    assert (ocr_smoke.model.name, ocr_smoke.train.device) == ("crnn_tiny", "cpu")
    assert ocr_smoke.loader.num_workers == 2 and ocr_smoke.train.max_steps
    resnet_gpu = load_config(REPO_ROOT / "configs/resnet50/single_gpu.yaml")
    assert resnet_gpu.loader.batch_size == 256 and resnet_gpu.train.amp == "bf16"
    assert resnet_gpu.loader.prefetch_factor == 4 and resnet_gpu.loader.pin_memory
    for task in ("ocr", "resnet50"):
        remote = load_config(REPO_ROOT / f"configs/{task}/remote_storage.yaml")
        assert remote.data.train.startswith("s3://") and remote.loader.persistent_workers
        small = load_config(REPO_ROOT / f"configs/{task}/small_dataset.yaml")
        assert small.data.cache == "memory"


def local_paths(config: Config) -> dict[str, str]:
    """The config's local dataset paths by key (s3:// URLs are not local)."""
    names = ("train", "val", "skip_keys_file", *tasks.get(config.task).input_files)
    paths = {f"data.{n}": getattr(config.data, n) for n in names}
    return {key: path for key, path in paths.items() if path and not path.startswith("s3://")}


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_scenarios_use_the_images_roots(path: Path, monkeypatch):
    """Every scenario file works unchanged in the images, whose ENV sets the roots, and in a
    checkout, where they are unset."""
    task = path.parent.name
    for name, value in IMAGE_ROOTS.items():
        monkeypatch.setenv(name, value)
    inside = load_config(path, _without_weights(path))
    data_paths = local_paths(inside)
    assert "data.train" in data_paths or inside.data.train.startswith("s3://")
    for key, value in data_paths.items():
        assert value.startswith(IMAGE_DATA_ROOTS), f"{key}: {value}"
    assert inside.output.dir == f"/runs/{task}-{inside.framework}-{path.stem}"
    assert inside.data.cache_dir.startswith("/cache/"), inside.data.cache_dir
    assert inside.data.remote_cache_dir.startswith("/cache/"), inside.data.remote_cache_dir

    for name in IMAGE_ROOTS:
        monkeypatch.delenv(name)
    checkout = load_config(path, _without_weights(path))
    for key, value in local_paths(checkout).items():
        assert value.startswith("data/synth_"), f"{key}: {value}"
    assert checkout.output.dir == f"runs/{task}-{checkout.framework}-{path.stem}"
    assert checkout.data.cache_dir.startswith(".cache/"), checkout.data.cache_dir
    assert checkout.data.remote_cache_dir.startswith(".cache/"), checkout.data.remote_cache_dir
    # only the roots differ
    assert dataclasses.replace(inside, data=checkout.data, output=checkout.output) == checkout


# ---------------------------------------------------------------- ${NAME:-default} substitution
def with_train(value: str) -> dict:
    return {**MINIMAL, "data": {"train": value}}


def test_env_reference_is_replaced(monkeypatch):
    monkeypatch.setenv("STARVED_TEST_ROOT", "/mnt/x")
    config = config_from_dict(with_train("${STARVED_TEST_ROOT}/a.h5"))
    assert config.data.train == "/mnt/x/a.h5"
    config = config_from_dict(with_train("${STARVED_TEST_ROOT:-d}/a-${STARVED_TEST_ROOT}.h5"))
    assert config.data.train == "/mnt/x/a-/mnt/x.h5"


def test_env_reference_unset_without_default_names_key_variable_and_fix(monkeypatch):
    monkeypatch.delenv("STARVED_TEST_UNSET", raising=False)
    with pytest.raises(ConfigError) as caught:
        config_from_dict(with_train("${STARVED_TEST_UNSET}/a.h5"), name="mine")
    message = str(caught.value)
    assert "\n" not in message and message.startswith("config error: mine: data.train: ")
    assert "environment variable STARVED_TEST_UNSET is not set" in message
    assert "Export STARVED_TEST_UNSET=..., or give a default" in message
    assert "${STARVED_TEST_UNSET:-value}" in message


@pytest.mark.parametrize("value", ["", None])
def test_env_reference_default_when_unset_or_empty(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("STARVED_TEST_ROOT", raising=False)
    else:
        monkeypatch.setenv("STARVED_TEST_ROOT", value)
    config = config_from_dict(with_train("${STARVED_TEST_ROOT:-data/d}/a.h5"))
    assert config.data.train == "data/d/a.h5"
    config = config_from_dict(with_train("${STARVED_TEST_ROOT:-}a.h5"))  # an empty default
    assert config.data.train == "a.h5"


def test_double_dollar_is_a_literal(monkeypatch):
    monkeypatch.setenv("STARVED_TEST_ROOT", "/mnt/x")
    config = config_from_dict(with_train("data/$${STARVED_TEST_ROOT}/cost$5.h5"))
    assert config.data.train == "data/${STARVED_TEST_ROOT}/cost$5.h5"


@pytest.mark.parametrize("reference", ["${1X}", "${}", "${A-B}", "${A:-b", "${A B}"])
def test_bad_env_reference_is_an_error(reference):
    if "}" not in reference:  # not a reference at all: kept as written
        assert config_from_dict(with_train(reference)).data.train == reference
        return
    with pytest.raises(ConfigError) as caught:
        config_from_dict(with_train(reference))
    message = str(caught.value)
    assert f"data.train: bad variable reference {reference}" in message and "\n" not in message
    assert "${NAME:-default}" in message


def test_env_reference_in_a_set_value(monkeypatch):
    monkeypatch.setenv("STARVED_TEST_ROOT", "/mnt/x")
    config = load_config(
        REPO_ROOT / "configs/ocr/smoke.yaml",
        ["output.dir=${STARVED_TEST_ROOT}/{config_name}", "data.val=${STARVED_TEST_NONE:-v}"],
    )
    assert config.output.dir == "/mnt/x/smoke" and config.data.val == "v"
    monkeypatch.delenv("STARVED_TEST_ROOT")
    item = "output.dir=${STARVED_TEST_ROOT}/runs"
    with pytest.raises(ConfigError) as caught:
        load_config(REPO_ROOT / "configs/ocr/smoke.yaml", [item])
    assert str(caught.value).startswith(f"config error: --set {item}: output.dir: environment")


def test_env_error_names_the_file_that_set_the_key(tmp_path: Path, monkeypatch):
    monkeypatch.delenv("STARVED_TEST_UNSET", raising=False)
    (tmp_path / "base.yaml").write_text(
        "task: classification\nframework: torch\ndata:\n  train: ${STARVED_TEST_UNSET}/t.h5\n"
    )
    (tmp_path / "child.yaml").write_text("extends: base.yaml\nseed: 3\n")
    with pytest.raises(ConfigError) as caught:
        load_config(tmp_path / "child.yaml")
    message = str(caught.value)
    assert "base.yaml: data.train: environment variable STARVED_TEST_UNSET" in message
    assert "child.yaml" not in message
    # the same reference set by the child is blamed on the child; --set fixes it there
    (tmp_path / "child.yaml").write_text(
        "extends: base.yaml\ndata:\n  val: ${STARVED_TEST_UNSET}/v.h5\n  train: t.h5\n"
    )
    with pytest.raises(ConfigError, match=r"child\.yaml: data\.val: environment variable"):
        load_config(tmp_path / "child.yaml")
    assert load_config(tmp_path / "child.yaml", ["data.val=v.h5"]).data.val == "v.h5"


@pytest.mark.parametrize(
    "name",
    ["AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "HF_TOKEN", "PGPASSWORD", "MY_CREDENTIALS"],
)
def test_secret_looking_variables_are_never_substituted(monkeypatch, tmp_path, name):
    """The resolved config is saved with the run and printed: a secret must not reach either."""
    monkeypatch.setenv(name, "hunter2-secret-value")
    with pytest.raises(ConfigError) as caught:
        config_from_dict(with_train(f"s3://bucket/${{{name}}}/a.h5"), name="mine")
    message = str(caught.value)
    assert f"data.train: ${{{name}}} looks like a secret" in message and "\n" not in message
    assert "hunter2" not in message
    # A name that only contains such a word inside another one is an ordinary variable.
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "x")
    assert config_from_dict(with_train("${TOKENIZERS_PARALLELISM}.h5")).data.train == "x.h5"


def test_resolved_config_is_written_owner_only(tmp_path):
    config = load_config(REPO_ROOT / "configs/ocr/smoke.yaml")
    path = save_resolved(config, tmp_path / "run")
    assert path.stat().st_mode & 0o777 == 0o600


def test_env_reference_outside_strings_and_in_lists(monkeypatch):
    monkeypatch.setenv("STARVED_TEST_ROOT", "/mnt/x")
    data = {"train": "t", "char_dict": "c.txt", "image_shape": [3, 32, 320]}
    config = config_from_dict({**MINIMAL, "task": "ocr", "data": data, "seed": 4})
    assert config.data.image_shape == [3, 32, 320] and config.seed == 4
    with pytest.raises(ConfigError, match=r"data\.image_shape\[1\]"):
        config_from_dict(
            {**MINIMAL, "data": {"train": "t.h5", "image_shape": [3, "${STARVED_TEST_NONE}", 9]}}
        )


def test_resolved_config_keeps_an_escaped_dollar(tmp_path: Path):
    config = config_from_dict(with_train("data/$${NOT_A_VARIABLE}/t.h5"))
    assert load_config(save_resolved(config, tmp_path)) == config


# ---------------------------------------------------------------- malformed files
def test_every_bad_config_fixture_has_an_expected_error():
    on_disk = {path.name for path in BAD_CONFIGS}
    assert len(on_disk) >= 20
    assert on_disk == set(EXPECTED_ERRORS), "fixture files and EXPECTED_ERRORS must match"


@pytest.mark.parametrize("path", BAD_CONFIGS, ids=lambda p: p.name)
def test_bad_config_gives_one_line_error(path: Path):
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("config error: ")
    assert "bad_configs/" in message, "the error names the file"
    assert EXPECTED_ERRORS[path.name] in message


@pytest.mark.parametrize(
    "name",
    ["typo_with_suggestion.yaml", "invalid_syntax.yaml", "extends_cycle_a.yaml", "empty.yaml"],
)
def test_cli_prints_one_line_and_exits_2(name: str):
    result = run_cli(str(BAD_CONFIGS_DIR / name))
    assert result.returncode == 2
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert EXPECTED_ERRORS[name] in result.stderr


def test_cli_prints_resolved_yaml():
    result = run_cli("configs/ocr/smoke.yaml", "--set", "loader.batch_size=8")
    assert result.returncode == 0, result.stderr
    printed = yaml.safe_load(result.stdout)
    assert printed["loader"]["batch_size"] == 8
    assert printed["output"]["dir"] == "runs/ocr-paddle-smoke"


def test_cli_get_prints_one_resolved_value():
    """What the Makefile's tune target reads to pick its venv: the value after extends and --set."""
    assert run_cli("configs/ocr/single_gpu.yaml", "--get", "framework").stdout == "paddle\n"
    assert run_cli("configs/resnet50/smoke.yaml", "--get", "task").stdout == "classification\n"
    swapped = run_cli("configs/ocr/smoke.yaml", "--set", "framework=torch", "--get", "framework")
    assert swapped.stdout == "torch\n"
    nested = run_cli("configs/ocr/smoke.yaml", "--set", "loader.batch_size=8", "--get", "loader")
    assert yaml.safe_load(nested.stdout)["batch_size"] == 8
    missing = run_cli("configs/ocr/smoke.yaml", "--get", "loader.no_such_knob")
    assert missing.returncode == 2 and missing.stdout == ""
    assert "loader.no_such_knob" in missing.stderr


def test_cli_missing_file_exits_2():
    result = run_cli("configs/ocr/no_such_scenario.yaml")
    assert result.returncode == 2 and "file not found" in result.stderr


# ---------------------------------------------------------------- --set overrides
def test_set_overrides_are_parsed_as_yaml_values():
    config = load_config(
        REPO_ROOT / "configs/ocr/smoke.yaml",
        [
            "loader.num_workers=4",
            "data.cache_max_bytes=512m",
            "optim.lr=0.01",
            "train.max_steps=",  # empty value: null
            "model.name=crnn",
        ],
    )
    assert config.loader.num_workers == 4
    assert config.data.cache_max_bytes == 512 * 1024**2
    assert config.optim.lr == 0.01
    assert config.train.max_steps is None
    assert config.model.name == "crnn"


def test_set_unknown_key_suggests_and_names_the_override():
    with pytest.raises(ConfigError) as caught:
        load_config(REPO_ROOT / "configs/ocr/smoke.yaml", ["loader.num_wrkers=4"])
    message = str(caught.value)
    assert "--set loader.num_wrkers=4" in message
    assert "Did you mean loader.num_workers?" in message


def test_set_unknown_section_is_blamed_on_the_override():
    with pytest.raises(ConfigError, match=r"--set lodaer.batch_size=4: lodaer: unknown key"):
        load_config(REPO_ROOT / "configs/ocr/smoke.yaml", ["lodaer.batch_size=4"])


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("loader.batch_size=many", "loader.batch_size: expected int, got 'many'"),
        ("loader.batch_size='8'", "expected int, got '8' (str)"),  # quoted in YAML: a string
        ("train.amp=fp8", "train.amp: expected one of"),
        ("loader.batch_size", "expected KEY=VALUE"),
        ("seed.value=1", "seed: is a value, not a section"),
    ],
)
def test_set_bad_values_are_rejected(override: str, expected: str):
    with pytest.raises(ConfigError) as caught:
        load_config(REPO_ROOT / "configs/resnet50/smoke.yaml", [override])
    assert expected in str(caught.value)
    assert "\n" not in str(caught.value)


# ---------------------------------------------------------------- types, sizes, extends
@pytest.mark.parametrize(
    ("text", "size"),
    [
        (1024, 1024),
        ("100", 100),
        ("512m", 512 * 1024**2),
        ("8g", 8 * 1024**3),
        ("8GB", 8 * 1024**3),
        ("1.5GiB", int(1.5 * 1024**3)),
        ("64 MiB", 64 * 1024**2),
        ("2k", 2048),
    ],
)
def test_size_strings(text, size):
    config = config_from_dict(MINIMAL, overrides=[f"data.cache_max_bytes={text}"])
    assert config.data.cache_max_bytes == size


@pytest.mark.parametrize("junk", ["lots", "-1", "8x", "1.5.2g", "g"])
def test_bad_size_strings(junk):
    with pytest.raises(ConfigError, match="data.cache_max_bytes: expected a size"):
        config_from_dict(MINIMAL, overrides=[f"data.cache_max_bytes={junk}"])


def test_int_is_accepted_for_float_but_bool_is_not():
    assert config_from_dict(MINIMAL, overrides=["optim.lr=1"]).optim.lr == 1.0
    with pytest.raises(ConfigError, match=r"got True \(bool\)\. A bool"):
        config_from_dict(MINIMAL, overrides=["optim.lr=true"])


def test_defaults_fill_by_task_and_file_name():
    config = config_from_dict(MINIMAL, name="mine")
    assert config.model.name == "resnet50"
    assert config.output.dir == "runs/classification-torch-mine"
    assert config.loader.num_workers == "auto" and config.loader.prefetch_factor is None
    assert config.data.cache_max_bytes == 2 * 1024**3


def test_config_is_frozen():
    config = config_from_dict(MINIMAL)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.seed = 1  # type: ignore[misc]
    assert isinstance(config, Config)


def test_extends_deep_merges_dicts_and_replaces_lists(tmp_path: Path):
    (tmp_path / "base.yaml").write_text(
        "task: ocr\nframework: paddle\n"
        "data: {train: t, char_dict: c.txt, image_shape: [3, 32, 100]}\n"
        "loader: {batch_size: 16, num_workers: 3}\n"
    )
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "middle.yaml").write_text("extends: ../base.yaml\nseed: 7\n")
    (tmp_path / "child.yaml").write_text(
        "extends: sub/middle.yaml\nloader: {batch_size: 8}\ndata: {image_shape: [1, 48, 320]}\n"
    )
    config = load_config(tmp_path / "child.yaml")
    assert (config.loader.batch_size, config.loader.num_workers) == (8, 3)
    assert config.data.image_shape == [1, 48, 320] and config.data.char_dict == "c.txt"
    assert config.seed == 7


def test_extends_not_beside_the_file_is_found_from_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO_ROOT)
    (tmp_path / "tuned.yaml").write_text("extends: configs/resnet50/smoke.yaml\nseed: 5\n")
    config = load_config(tmp_path / "tuned.yaml")
    assert config.seed == 5 and config.model.name == "resnet18"
    # A file beside it wins: the rule relative to the containing file comes first.
    (tmp_path / "configs" / "resnet50").mkdir(parents=True)
    (tmp_path / "configs" / "resnet50" / "smoke.yaml").write_text(
        "extends: " + str(REPO_ROOT / "configs/resnet50/smoke.yaml") + "\nseed: 9\n"
    )
    assert load_config(tmp_path / "tuned.yaml").seed == 5
    (tmp_path / "tuned.yaml").write_text("extends: configs/resnet50/smoke.yaml\n")
    assert load_config(tmp_path / "tuned.yaml").seed == 9


def test_extends_accepts_an_absolute_path(tmp_path: Path):
    (tmp_path / "child.yaml").write_text(
        f"extends: {REPO_ROOT / 'configs/resnet50/smoke.yaml'}\nseed: 5\n"
    )
    config = load_config(tmp_path / "child.yaml")
    assert config.seed == 5 and config.model.name == "resnet18"
    assert config.output.dir == "runs/resnet50-torch-child"


def test_relative_data_paths_are_kept_as_written():
    config = load_config(REPO_ROOT / "configs/ocr/base.yaml")
    assert config.data.train == "data/synth_ocr/train"  # relative to the repository root


# ---------------------------------------------------------------- num_workers: auto
@pytest.mark.parametrize(
    ("cores", "workers"), [(1, 1), (2, 1), (4, 3), (8, 6), (11, 8), (16, 8), (128, 8)]
)
def test_resolve_num_workers_auto(cores: int, workers: int):
    count, reason = resolve_num_workers("auto", cpu_count=cores)
    assert count == workers
    assert reason == f"auto: min(8, 0.75 x {cores} cores) = {workers}"


def test_resolve_num_workers_shares_cores_between_ranks():
    assert resolve_num_workers("auto", cpu_count=32, local_world_size=4)[0] == 6
    assert resolve_num_workers("auto", cpu_count=2, local_world_size=8)[0] == 1


def test_resolve_num_workers_passes_numbers_through_and_reads_this_machine():
    assert resolve_num_workers(0) == (0, "set in config: 0")
    assert resolve_num_workers(12)[0] == 12
    count, reason = resolve_num_workers("auto")
    assert 1 <= count <= 8 and reason.startswith("auto: min(8, 0.75 x ")


def test_resolve_puts_the_counts_into_the_config_the_loaders_read():
    from train.config.schema import DEFAULT_PREFETCH_FACTOR
    from train.data import resolve

    config = load_config(REPO_ROOT / "configs/ocr/base.yaml")
    assert config.loader.num_workers == "auto" and config.loader.prefetch_factor is None
    resolved = resolve(config, local_world_size=2, cpu_count=16, stage=None)
    assert resolved.config.loader.num_workers == 6
    assert resolved.workers_reason == "auto: min(8, 0.75 x 16 cores / 2 ranks) = 6"
    assert resolved.config.loader.prefetch_factor == DEFAULT_PREFETCH_FACTOR
    expected = dataclasses.replace(
        config.loader, num_workers=6, prefetch_factor=DEFAULT_PREFETCH_FACTOR
    )
    assert resolved.config.loader == expected  # nothing else changes
    assert resolved.config.data == config.data and resolved.staged == {}
    assert config.loader.num_workers == "auto"  # a copy
    # A prefetch the config sets is kept.
    set_prefetch = load_config(REPO_ROOT / "configs/resnet50/single_gpu.yaml")
    kept = resolve(set_prefetch, cpu_count=16, stage=None).config.loader
    assert kept.prefetch_factor == set_prefetch.loader.prefetch_factor == 4


# ---------------------------------------------------------------- each task's own data section
def test_each_task_parses_data_as_its_own_section():
    for task in TASKS.values():
        folder = REPO_ROOT / task.scenario_dir
        config = load_config(folder / "smoke.yaml")
        assert type(config.data) is task.data, task.name
    assert not hasattr(load_config(REPO_ROOT / "configs/ocr/smoke.yaml").data, "image_size")
    assert not hasattr(load_config(REPO_ROOT / "configs/resnet50/smoke.yaml").data, "char_dict")


def test_a_config_with_every_tasks_data_keys_at_their_defaults_still_loads():
    """A config written when one flat data section held every task's keys (a run's
    config.resolved.yaml holds them all) loads: the other tasks' keys at their defaults."""
    flat = {
        "train": "t",
        "char_dict": None,
        "use_space_char": False,
        "image_shape": [3, 48, 320],
        "max_text_length": 25,
        "image_size": 96,
        "eval_resize": 256,
    }
    config = config_from_dict({**MINIMAL, "data": flat})
    assert (config.data.image_size, config.data.eval_resize) == (96, 256)
    ocr_data = {**flat, "char_dict": "c.txt", "image_size": 224}  # the old default
    ocr = config_from_dict({**MINIMAL, "task": "ocr", "data": ocr_data})
    assert ocr.data.char_dict == "c.txt" and not hasattr(ocr.data, "image_size")
    assert type(ocr.data) is tasks.get("ocr").data


def test_another_tasks_data_key_set_is_an_error_naming_its_task():
    data = {"train": "t", "image_shape": [3, 32, 100]}
    with pytest.raises(ConfigError, match=r"data\.image_shape: is a data key of task ocr") as err:
        config_from_dict({**MINIMAL, "data": data})
    assert "set task: ocr" in str(err.value)
