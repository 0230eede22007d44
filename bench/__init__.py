"""Input-pipeline benchmark helpers for scripts/bench_loader.py (see docs/benchmarks.md)."""
