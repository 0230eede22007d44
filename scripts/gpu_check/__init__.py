r"""The first GPU run in two commands: ``setup`` (venvs, probes, data) and ``run`` (throughput,
compile, batch ring, AMP, resume, fine-tune and export, two ranks), each one JSON object.

    bash scripts/gpu_check.sh setup   # a host with one NVIDIA GPU: at most 5 minutes
    bash scripts/gpu_check.sh run     # at most 7 minutes, most important first
    bash scripts/gpu_check.sh setup --dry-run; bash scripts/gpu_check.sh run --dry-run  # CPU

What it measures and how to read the JSON: docs/first_gpu_run.md.

The orchestrator (``main``) uses the standard library only: it runs on the host's python3 before
any venv exists, makes the venvs (GPU mode) and runs every check as a child process of a venv's
python, so a check that fails, hangs or aborts inside a CUDA library is recorded in the JSON and
the next one runs. The children are this package's helper commands, whose names start with "_":
``_probe`` (framework build, a few ops and a training step on the device), ``_configs``,
``_data`` (synthetic datasets), ``_train`` (``python -m train`` plus peak device memory and the
fp16 loss scale), ``_synthetic`` (ResNet-50 steps on random device tensors), ``_toolchain``
(what torch.compile needs) and ``_ranks`` (a rank of the two-rank gloo run).

Progress goes to stderr, the JSON to stdout and, with a Markdown table, into the work folder
after every check. Exit 0: every check ran (its status, ok or error, is in the JSON); 3: some
checks were skipped (the budget, --only, a missing compiler: each says why); 1: the script itself
broke (the JSON then has script_error) or run found no setup; 2: bad command line.

Modules (run as ``python -m scripts.gpu_check``, which __main__.py dispatches):
  orchestrator side (standard library only)
    plan.py         the GPU and dry-run plans, check names and order, shared constants
    util.py         progress lines, --set items, log and JSON reading, the GPU-CHECK line
    context.py      Context: children in their own sessions, logs, timeouts, the budget
    sampler.py      the 10 Hz GPU sampler beside each training run (nvidia-smi)
    commands.py     the ``python -m train`` command lines of a plan
    runs.py         reading a run directory (metrics.jsonl, checkpoints, train.log, windows)
    venvs.py        venvs, pip installs, NVIDIA wheels' CUDA libraries
    setup.py        setup.torch and setup.paddle (which build runs, probed on the device)
    checks.py       configs, data, throughput, compile, AMP, smoke, fine-tune, two-rank checks
    report.py       the JSON's skeleton, host facts, summary, the Markdown table
    orchestrate.py  the order of the checks: setup, then run (timed, then correctness)
    cli.py          the command line, the reports, the exit code
  helper side (run in a framework's venv)
    helpers.py      _configs, _data, _train, _synthetic, _toolchain, _ranks and their command line
    device_probe.py _probe
"""
