"""One tuning, top to bottom: measure, model, verify, pick. The command line (__main__.py) and
the benchmark's sweep (bench/tune_sweep.py) call :func:`tune`."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field

from train import preflight, tasks
from train.data import sample_policy
from train.tune import measure, model, verify

log = logging.getLogger("train.tune")

WITHIN = 0.03  # a setting within 3% of the fastest is as good: take the cheapest such
# Shares of the budget: the stage costs, the step, and the measured runs (the rest).
STAGES_SHARE, STEP_SHARE = 0.1, 0.1


@dataclass
class Tuning:
    """What one tuning found, everything the report shows."""

    host: model.Host
    costs: model.StageCosts
    stages: dict  # measure.describe's summary
    step: dict  # {"step_s", "source", ...}
    target: model.Target
    plan: model.Plan
    configured: model.Candidate | None = None  # the scenario's own setting
    measured: list[verify.Measured] = field(default_factory=list)
    pick: model.Candidate | None = None
    bottleneck: str = ""
    elapsed_s: float = 0.0

    def measured_rate(self, candidate: model.Candidate) -> float | None:
        rates = [m.samples_per_s for m in self.measured if m.candidate == candidate]
        return max(rates) if rates else None

    def predicted_rate(self, candidate: model.Candidate) -> float:
        return model.predict(self.costs, self.host, self.target, candidate).samples_per_s


def open_train_dataset(config, cache: str = "none"):
    data = dataclasses.replace(config.data, cache=cache)
    return tasks.get(config.task).open_dataset(
        data, data.train, train=True, seed=config.seed, **sample_policy(data)
    )


def configured(config) -> model.Candidate:
    """The scenario's own setting (num_workers resolved) as a candidate."""
    loader = config.loader
    if loader.num_workers == 0:
        return model.Candidate(0, 1, config.data.cache, False)
    return model.Candidate(
        loader.num_workers, loader.prefetch_factor or 2, config.data.cache, loader.batch_ring
    )


def shm_need(config, local_ranks: int):
    def need(candidate: model.Candidate) -> int:
        return preflight.plan(verify.with_candidate(config, candidate), local_ranks).need_bytes

    return need


def prepare(config, step_ms: float | None, local_ranks: int, held: list):
    """(config with local data and num_workers resolved, backend made and initialized as one
    process). ``held`` gets the backend's shutdown. With ``step_ms`` the device is elsewhere:
    a config asking for a GPU runs its loader here, on whatever device this host has."""
    from train.backends import make_backend
    from train.cpus import resolve_loader
    from train.data import stage_remote

    if step_ms is not None and config.train.device == "gpu":
        config = dataclasses.replace(config, train=dataclasses.replace(config.train, device="auto"))
    config = dataclasses.replace(config, data=stage_remote(config))
    config, reason = resolve_loader(config, local_world_size=local_ranks)
    log.info("the scenario's num_workers here: %d (%s)", config.loader.num_workers, reason)
    backend = make_backend(config)
    held.append(backend.shutdown)
    backend.init_distributed()
    backend.seed_everything(config.seed, config.deterministic)
    return config, backend


def tune(config, backend, step_ms: float | None, budget_s: float, local_ranks: int = 1) -> Tuning:
    """Tune ``config``'s loader for this host. ``backend`` is made and its distributed part
    initialized (one process); ``step_ms``: the device's step when it is elsewhere (None:
    measured here with the model)."""
    started = time.perf_counter()
    batch = config.loader.batch_size
    dataset = open_train_dataset(config)
    try:
        log.info("measuring each stage on the training data (%s)", config.data.train)
        sample = measure.time_stages(dataset, batch, config.seed, max(2.0, budget_s * STAGES_SHARE))
        on_device = step_ms is None  # the step runs here: batches go to its device
        trainer = measure.trainer_seconds(config, backend, dataset, on_device)
        costs = measure.summarize(sample, trainer)
        stages = measure.describe(sample, costs)
        host = measure.host_facts(config.data, costs.sample_bytes * batch)
        if step_ms is not None:
            step = {"step_s": step_ms / 1e3, "source": "--step-ms"}
        else:
            log.info("measuring the model's step on %s", backend.device_name)
            step = measure.step_seconds(
                config, backend, dataset, batch, max(1.0, budget_s * STEP_SHARE)
            )
            step["source"] = "measured"
    finally:
        dataset.close()
    target = model.Target(
        framework=config.framework,
        batch_size=batch,
        step_s=step["step_s"],
        local_ranks=local_ranks,
        cache_max_bytes=config.data.cache_max_bytes,
        shm_need=shm_need(config, local_ranks),
    )
    plan = model.plan(costs, host, target, WITHIN)
    tuning = Tuning(host, costs, stages, step, target, plan, configured=configured(config))
    # The scenario's own setting second, so the speed-up over it is measured within any budget.
    to_verify = [plan.to_verify[0]]
    to_verify += [c for c in (tuning.configured, *plan.to_verify[1:]) if c not in to_verify]
    device = (
        verify.RealStep(backend)
        if step_ms is None and backend.uses_gpu
        else verify.DeviceStandIn(target.step_s)
    )
    spent = time.perf_counter() - started
    left = max(0.0, budget_s - spent)
    window_s = min(5.0, max(1.0, left / (2.0 * len(to_verify))))
    for candidate in to_verify:
        if tuning.measured and time.perf_counter() - started > budget_s:
            log.warning("budget spent: %s not measured", candidate.label())
            continue
        expected = tuning.predicted_rate(candidate)
        result = verify.measure(
            config, backend, candidate, device, window_s, expected, on_device=step_ms is None
        )
        log.info(
            "%s: %.0f samples/s measured, %.0f predicted",
            candidate.label(),
            result.samples_per_s,
            expected,
        )
        tuning.measured.append(result)
    choose(tuning)
    tuning.elapsed_s = time.perf_counter() - started
    return tuning


def choose(tuning: Tuning) -> None:
    """The cheapest measured setting within WITHIN of the fastest measured, and its bottleneck:
    the device when it ran at the device's rate, otherwise what the model says holds it."""
    pick = model.cheapest_within(tuning.measured, lambda m: m.samples_per_s, WITHIN)
    tuning.pick = pick.candidate
    device_rate = tuning.target.batch_size / tuning.target.step_s
    predicted = model.predict(tuning.costs, tuning.host, tuning.target, pick.candidate)
    if pick.samples_per_s >= (1 - WITHIN) * device_rate:
        tuning.bottleneck = model.GPU
    elif tuning.plan.bottleneck == model.SHM:
        tuning.bottleneck = model.SHM
    elif predicted.bottleneck == model.GPU:
        # The model expected the device to be the limit and the loader fell short of it: the
        # loader's own cost is what holds it (the model underestimated it).
        slow_reads = tuning.costs.read_s > tuning.costs.transform_s
        tuning.bottleneck = model.DISK if slow_reads else model.CPU
    else:
        tuning.bottleneck = predicted.bottleneck
