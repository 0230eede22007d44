"""python -m train.config FILE [--set KEY=VALUE ...]: check a config and print it resolved."""

from __future__ import annotations

import argparse
import sys

import yaml

from train.config import ConfigError, add_overrides_argument, load_config
from train.cpus import resolve_loader


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
    resolved, reason = resolve_loader(config)
    print(f"# loader.num_workers on this machine: {resolved.loader.num_workers} ({reason})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
