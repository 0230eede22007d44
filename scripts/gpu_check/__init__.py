r"""The first GPU run in one command: set-up, smoke trainings, AMP, throughput, one JSON object.

    bash scripts/gpu_check.sh > gpu_check.json   # a host with one NVIDIA GPU
    bash scripts/gpu_check.sh --dry-run          # the same code paths on the CPU, no installs

What it measures and how to read the JSON: docs/first_gpu_run.md.

The orchestrator (``main``) uses the standard library only: it runs on the host's python3 before
any venv exists, makes the venvs (GPU mode) and runs every check as a child process of a venv's
python, so a check that fails, hangs or aborts inside a CUDA library is recorded in the JSON and
the next one runs. The children are this package's helper commands, whose names start with "_":
``_probe`` (framework build and a few ops on the device), ``_data`` (synthetic datasets),
``_train`` (``python -m train`` plus peak device memory) and ``_synthetic`` (ResNet-50 steps
on random device tensors).

Progress goes to stderr, the JSON to stdout. Exit 0: every check ran (its status, ok or error,
is in the JSON); 3: the time budget (GPU_CHECK_BUDGET_S) left some checks skipped; 1: the script
itself broke (the JSON then has script_error); 2: bad command line.

Modules (run as ``python scripts/gpu_check``, which __main__.py dispatches):
  orchestrator side (standard library only)
    plan.py         the GPU and dry-run plans, check names, shared constants
    util.py         progress lines, --set items, log and JSON reading, the GPU-CHECK line
    context.py      Context: children in their own sessions, logs, timeouts, the budget
    commands.py     the ``python -m train`` command lines of a plan
    runs.py         reading a run directory (metrics.jsonl, checkpoints, train.log)
    venvs.py        venvs, pip installs, NVIDIA wheels' CUDA libraries
    setup.py        setup.torch and setup.paddle (which build runs, probed on the device)
    checks.py       configs, data, smoke, AMP and throughput checks
    report.py       the JSON's skeleton, host facts, summary
    orchestrate.py  the order of the checks, the two phases
    cli.py          the command line, the exit code
  helper side (run in a framework's venv)
    helpers.py      _configs, _data, _train, _synthetic and their command line
    device_probe.py _probe
"""
