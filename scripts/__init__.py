"""Command-line tools: synthetic data, converters, validation, the benchmark and the GPU check.

Each runs as ``python -m scripts.NAME`` (from the repository root, or anywhere once the project
is installed: ``pip install --no-deps -e .``); ``python scripts/NAME.py`` works too where the
project is installed.
"""
