r"""The first GPU run in one command, on the PyTorch a GPU host already has: probes, data,
throughput, compile, batch ring, AMP, resume, fine-tune and export, two ranks; one JSON object.

    bash scripts/gpu_check.sh --python "$(command -v python3)" --wheelhouse DIR   # <= 9 minutes
    bash scripts/gpu_check.sh --dry-run      # the same code paths on the CPU (make test)

What it measures and how to read the JSON: docs/first_gpu_run.md.

Nothing is installed from a network: the check runs with the interpreters it is given (--python
for torch, --paddle-python for Paddle, which is skipped where no Paddle build imports), plus the
wheels of --wheelhouse installed with --no-index into a scratch folder. The orchestrator
(``main``) uses the standard library only and runs every check as a child process, so a check
that fails, hangs or aborts inside a CUDA library is recorded in the JSON and the next one runs.
The children are this package's helper commands, whose names start with "_": ``_probe``
(framework build, a few ops and a training step on the device), ``_configs``, ``_data``
(synthetic datasets), ``_train`` (``python -m train`` plus peak device memory and the fp16 loss
scale), ``_synthetic`` (ResNet-50 steps on random device tensors), ``_toolchain`` (what
torch.compile needs) and ``_ranks`` (a rank of the two-rank gloo run).

Progress goes to stderr, the JSON to stdout (then a short summary as the last lines) and, with a
Markdown table, into the work folder after every check. Exit 0: every check ran (its status, ok
or error, is in the JSON); 3: some checks were skipped (the budget, --only, no Paddle build, a
missing compiler: each says why); 1: the script itself broke (the JSON then has script_error);
2: bad command line.

Modules (run as ``python -m scripts.gpu_check``, which __main__.py dispatches):
  orchestrator side (standard library only)
    plan.py         the GPU and dry-run plans, check names and order, shared constants
    util.py         progress lines, --set items, log and JSON reading, the GPU-CHECK line
    context.py      Context: children in their own sessions, logs, timeouts, the budget
    sampler.py      the 10 Hz GPU sampler beside each training run (nvidia-smi)
    commands.py     the ``python -m train`` command lines of a plan
    runs.py         reading a run directory (metrics.jsonl, checkpoints, train.log, windows)
    setup.py        the wheelhouse, setup.torch and setup.paddle (probed on the device)
    checks.py       configs, data, throughput, compile, AMP, smoke, fine-tune, two-rank checks
    report.py       the JSON's skeleton, host facts, summary, the Markdown table
    orchestrate.py  the order of the checks: setup, timed, then correctness
    cli.py          the command line, the reports, the exit code
  helper side (run by the framework's interpreter)
    helpers.py      _configs, _data, _train, _synthetic, _toolchain, _ranks and their command line
    device_probe.py _probe
"""
