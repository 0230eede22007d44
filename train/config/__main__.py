"""python -m train.config FILE [--set KEY=VALUE ...] [--get KEY]: check a config and print it
resolved, or one value of it."""

from __future__ import annotations

import argparse
import json
import sys

import yaml

from train.cli import failure_exit_code
from train.config.errors import ConfigError
from train.config.load import add_overrides_argument, load_config


def lookup(resolved: dict, key: str):
    """The value at a dotted key path of the resolved config; KeyError when there is none."""
    value = resolved
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(key)
        value = value[part]
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m train.config", description="Check a config and print it fully resolved."
    )
    parser.add_argument("config", help="scenario YAML, e.g. configs/ocr/smoke.yaml")
    add_overrides_argument(parser)
    # For scripts (the Makefile's tune target picks its venv by framework): the one value alone,
    # after extends and --set, so that no caller parses YAML itself.
    parser.add_argument(
        "--get", metavar="KEY", help="print only this value (a dotted path: loader.num_workers)"
    )
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as error:
        return failure_exit_code(error)  # printed in one line, exit 2
    if args.get is not None:
        try:
            value = lookup(config.to_dict(), args.get)
        except KeyError:
            print(f"{args.get}: no such key in the resolved config", file=sys.stderr)
            return 2
        # A string as it is (what a shell wants); anything else as one line of JSON.
        print(value if isinstance(value, str) else json.dumps(value))
        return 0
    sys.stdout.write(yaml.safe_dump(config.to_dict(), sort_keys=False))
    from train.data import resolve  # the data layer: only for the worker count, not for --get

    resolved = resolve(config, stage=None)
    loader = resolved.config.loader
    print(
        f"# loader.num_workers on this machine: {loader.num_workers} ({resolved.workers_reason}); "
        f"prefetch_factor: {loader.prefetch_factor}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
