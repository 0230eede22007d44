"""Resolve every scenario YAML in this environment and check each local path it names.

    python -m scripts.check_scenarios                      # every file in configs/*/
    python -m scripts.check_scenarios configs/ocr/smoke.yaml --set train.device=cpu

For each scenario: the config validates (with the environment's ${NAME} roots substituted);
dataset and dictionary paths exist and are readable (s3:// URLs are skipped: training stages
them at start); the run directory and, where the config uses them, the cache directories can be
created and written. Both are asked by trying, as the doctor asks (train/paths.py). One line per
scenario and problem; exit 1 if any scenario failed.

CI runs it inside each image (the images set OCR_DATA_DIR, RESNET50_DATA_DIR, RUNS_ROOT and
CACHE_ROOT), which proves that swapping the scenario file is all a container user has to do.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from datasets.remote import is_remote
from train.config.errors import ConfigError
from train.config.load import add_overrides_argument, load_config
from train.paths import read_problem, write_problem

REPO_ROOT = Path(__file__).resolve().parent.parent


def scenario_problems(config) -> list[str]:
    """Everything about this config's paths that would stop a run here, one line each."""
    from train import tasks

    data = config.data
    problems = []
    for name in ("train", "val", "skip_keys_file", *tasks.get(config.task).input_files):
        path = getattr(data, name)
        if not path or is_remote(path):
            continue
        # Read first: a parent we may not enter would otherwise look like a missing path.
        problem = read_problem(path)
        if problem is None and not os.path.exists(path):
            problem = f"{path} does not exist"
        if problem is not None:
            problems.append(f"data.{name}: {problem}")
    directories = {"output.dir": config.output.dir}
    if data.cache == "disk":
        directories["data.cache_dir"] = data.cache_dir
    if any(is_remote(path or "") for path in (data.train, data.val)):
        directories["data.remote_cache_dir"] = data.remote_cache_dir
    for key, directory in directories.items():
        problem = write_problem(directory)
        if problem is not None:
            problems.append(f"{key}: {problem}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/check_scenarios.py", description=__doc__)
    parser.add_argument("configs", nargs="*", help="scenario files (default: configs/*/*.yaml)")
    add_overrides_argument(parser)
    args = parser.parse_args(argv)
    files = [Path(f) for f in args.configs] or sorted(REPO_ROOT.glob("configs/*/*.yaml"))
    failed = 0
    for path in files:
        try:
            config = load_config(path, args.overrides)
        except ConfigError as error:
            print(f"FAIL {path}: {error}")
            failed += 1
            continue
        problems = scenario_problems(config)
        failed += bool(problems)
        status = "FAIL" if problems else "ok  "
        print(f"{status} {path}: data {config.data.train}, runs {config.output.dir}")
        for problem in problems:
            print(f"       {problem}")
    print(f"{len(files) - failed} of {len(files)} scenarios ready here")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
