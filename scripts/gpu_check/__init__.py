r"""The first GPU run in one command, on the PyTorch a GPU host already has: probes, data,
throughput, compile, batch ring, AMP, resume, fine-tune and export, two ranks; one JSON object.

    bash scripts/gpu_check.sh --python "$(command -v python3)" --wheelhouse DIR   # <= 9 minutes
    bash scripts/gpu_check.sh --dry-run      # the same code paths on the CPU (make test)

What it measures, the JSON, the exit codes (0 every check ran, 3 some were skipped, 1 the script
broke, 2 bad command line): docs/first_gpu_run.md. Nothing comes from a network. The
orchestrator uses the standard library only and runs every check as a child process, so a check
that fails, hangs or aborts in a CUDA library is recorded and the next one runs.

Modules (run as ``python -m scripts.gpu_check``, which __main__.py dispatches):
  orchestrator side (the standard library and the project's stdlib-only train.launch and
  datasets.safe_files)
    commands.py   the GPU and dry-run plans, the check names, the ``python -m train`` commands
    context.py    Context: children, logs, timeouts, the budget, the GPU sampler
    checks.py     setup (wheelhouse, probes' verdicts), configs, data and every check
    cli.py        the command line, the order of the checks, the JSON, the table, the exit code
  helper side (the framework's interpreter)
    helpers.py    _probe, _configs, _data, _train, _synthetic, _ranks
"""
