"""Shared start-up for the scripts: repository root on sys.path, logging, one-line errors.

Scripts run as ``python scripts/NAME.py`` from anywhere; the project is never installed into
site-packages (its ``datasets`` package would shadow Hugging Face's), so we add the root here.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def run(main) -> None:
    """Call ``main()``; turn a DatasetError or WeightsError into one line on stderr and exit
    code 2."""
    from datasets.errors import DatasetError
    from train.ppocrv4_weights import WeightsError

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        sys.exit(main())
    except (DatasetError, WeightsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted: partial output removed", file=sys.stderr)
        sys.exit(130)
