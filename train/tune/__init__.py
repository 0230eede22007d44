"""The loader tuner, ``python -m train.tune``: measure the input pipeline on this host, model
it, verify the model's pick by short runs of the real loader, and write the settings that keep
the device fed (docs/tuning.md).

    measure.py  each stage's cost on the real data, the host's cores, memory, /dev/shm and copy
                rates, and the model's step (framework-free but for the step)
    model.py    the pipeline's model: predicted throughput and bottleneck of every setting (pure)
    verify.py   measured runs of the backend's loader at one setting, beside a device stand-in
    run.py      one tuning: measure, model, verify, pick
    report.py   tuned.yaml, report.json, report.md, throughput.png
"""
