"""One tuning, top to bottom: measure, model, verify, pick. The command line (__main__.py) and
the benchmark's sweep (bench/tune_sweep.py) call :func:`tune`."""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import time
from dataclasses import dataclass, field

from train import preflight
from train.tune import companions, measure, model, verify

log = logging.getLogger("train.tune")

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
WITHIN = 0.03  # a setting within 3% of the fastest is as good: take the cheapest such
# Runs of the pick and of each setting it is compared with, interleaved: their spread gives each
# a confidence interval, and no setting is picked on one run.
MIN_RUNS = 3
# Student's t at 95% (two-sided) by degrees of freedom; 1.96 past the table.
T_95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23}
# Shares of the budget: the stage costs, the step, and the measured runs (the rest; the
# hand-over's three short loader runs come out of it).
STAGES_SHARE, STEP_SHARE = 0.1, 0.1
DEFAULT_BUDGET_S = 300.0  # python -m train.tune's --budget-s, and the benchmark's


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
    unexplored: list[str] = field(default_factory=list)  # dimensions the budget left unsearched

    def rates(self) -> dict[model.Candidate, list[float]]:
        """Samples/s of each measured setting's runs, in the order first measured."""
        rates: dict[model.Candidate, list[float]] = {}
        for result in self.measured:
            rates.setdefault(result.candidate, []).append(result.samples_per_s)
        return rates

    def measured_rate(self, candidate: model.Candidate) -> float | None:
        """The median of the setting's runs (None: not measured)."""
        rates = self.rates().get(candidate)
        return statistics.median(rates) if rates else None

    def interval(self, candidate: model.Candidate) -> tuple[float, float] | None:
        """The 95% confidence interval of the setting's mean rate over its runs (Student's t);
        None below two runs, whose spread is unknown."""
        return confidence_interval(self.rates().get(candidate, []))

    def predicted_rate(self, candidate: model.Candidate) -> float:
        return model.predict(self.costs, self.host, self.target, candidate).samples_per_s


def confidence_interval(runs: list[float]) -> tuple[float, float] | None:
    if len(runs) < 2:
        return None
    half = T_95.get(len(runs) - 1, 1.96) * statistics.stdev(runs) / len(runs) ** 0.5
    mean = statistics.fmean(runs)
    return mean - half, mean + half


def as_good(tuning: Tuning, candidate: model.Candidate, fastest: model.Candidate) -> bool:
    """Whether ``candidate`` is as good as ``fastest``: within WITHIN of its median, or slower
    by less than the noise of the difference (one standard error of the difference of the two
    means, from their runs' spread). A costlier setting is then worth its cost only when its
    gain beats both the margin and that noise. Not "their 95% intervals overlap": with three
    runs each (Student's t of 4.3) that calls settings 20% apart alike on a shared host, and the
    cheaper one then loses what the costlier one reliably gains."""
    mine, best = tuning.measured_rate(candidate), tuning.measured_rate(fastest)
    if mine >= (1 - WITHIN) * best:
        return True
    runs, best_runs = tuning.rates()[candidate], tuning.rates()[fastest]
    if len(runs) < 2 or len(best_runs) < 2:
        return False
    noise = (
        statistics.variance(runs) / len(runs) + statistics.variance(best_runs) / len(best_runs)
    ) ** 0.5
    return best - mine <= noise


def current_pick(tuning: Tuning) -> tuple[model.Candidate, model.Candidate]:
    """(the cheapest setting as good as the fastest, the fastest), among the settings measured
    more than once when there are such: a single run's rate has no known spread."""
    rates = tuning.rates()
    repeated = [c for c, runs in rates.items() if len(runs) >= 2] or list(rates)
    fastest = max(repeated, key=tuning.measured_rate)
    good = [c for c in repeated if as_good(tuning, c, fastest)]
    return min(good, key=lambda c: c.cost()), fastest


def configured(config) -> model.Candidate:
    """The scenario's own setting (num_workers resolved) as a candidate."""
    loader = config.loader
    if loader.num_workers == 0:
        return model.Candidate(0, 1, config.data.cache, False)
    return model.Candidate(
        loader.num_workers, loader.prefetch_factor, config.data.cache, loader.batch_ring
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
    from train.data import resolve

    if step_ms is not None and config.train.device == "gpu":
        config = dataclasses.replace(config, train=dataclasses.replace(config.train, device="auto"))
    resolved = resolve(config, local_world_size=local_ranks)
    config = resolved.config
    log.info(
        "the scenario's num_workers here: %d (%s)",
        config.loader.num_workers,
        resolved.workers_reason,
    )
    level = logging.getLogger().level
    backend = make_backend(config)
    held.append(backend.runtime.shutdown)
    # Paddle's import sets up the root logger its own way (WARNING and up): put ours back.
    logging.basicConfig(level=level, format=LOG_FORMAT, force=True)
    backend.runtime.init_distributed()
    backend.runtime.seed_everything(config.seed, config.deterministic)
    return config, backend


def tune(config, backend, step_ms: float | None, budget_s: float, local_ranks: int = 1) -> Tuning:
    """Tune ``config``'s loader for this host. ``backend`` is made and its distributed part
    initialized (one process); ``step_ms``: the device's step when it is elsewhere (None:
    measured here with the model)."""
    started = time.perf_counter()
    batch = config.loader.batch_size
    dataset = verify.open_train_dataset(config, cache="none")
    try:
        log.info("measuring each stage on the training data (%s)", config.data.train)
        elsewhere = measure.OtherLoad().start()
        sample = measure.time_stages(dataset, batch, config.seed, max(2.0, budget_s * STAGES_SHARE))
        on_device = step_ms is None  # the step runs here: batches go to its device
        log.info("measuring the hand-over on the %s loader", config.framework)
        batch_s = statistics.median(sample.batch_s)
        runs = measure.handover(config, backend, dataset, on_device, batch_s)
        costs = measure.summarize(sample, runs)
        busy_elsewhere = elsewhere.stop()
        stages = measure.describe(sample, costs)
        host = measure.host_facts(config.data, costs.sample_bytes * batch, busy_elsewhere)
        if step_ms is not None:
            step = {"step_s": step_ms / 1e3, "source": "--step-ms"}
        else:
            log.info("measuring the model's step on %s", backend.runtime.device_name)
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
        step_on_cpu=step_ms is None and not backend.runtime.uses_gpu,
        local_ranks=local_ranks,
        cache_max_bytes=config.data.cache_max_bytes,
        shm_need=shm_need(config, local_ranks),
    )
    plan = model.plan(costs, host, target, WITHIN)
    tuning = Tuning(host, costs, stages, step, target, plan, configured=configured(config))
    # The step measured here runs for real; --step-ms's device is elsewhere: a stand-in.
    device = verify.RealStep(backend) if step_ms is None else verify.DeviceStandIn(target.step_s)
    deadline = started + budget_s
    window_s = min(5.0, max(1.0, (deadline - time.perf_counter()) / 16))
    check_budget(tuning, window_s, deadline - time.perf_counter(), budget_s)
    # With several ranks on the node, their loaders run beside each measured run (companions).
    with companions.started(config, local_ranks, target.step_s, target.step_on_cpu) as others:
        search(
            tuning,
            config,
            backend,
            device,
            window_s,
            deadline,
            on_device=step_ms is None,
            other_ranks=others,
        )
    choose(tuning)
    tuning.elapsed_s = time.perf_counter() - started
    return tuning


def check_budget(tuning: Tuning, window_s: float, left_s: float, budget_s: float) -> None:
    """A ConfigError (exit 2) when what the measurements of stages and step left of the budget
    cannot measure even the model's pick and the scenario's own setting once each (at their
    predicted rates: a lower bound), rather than a search of nothing that reads as a result."""
    from train.config.errors import ConfigError

    batch = tuning.target.batch_size

    def run_s(candidate: model.Candidate) -> float:
        rate = max(tuning.predicted_rate(candidate), 1e-9)
        windows = verify.window_batches(candidate.workers, window_s, rate, batch)
        return (candidate.workers + 1 + windows) * batch / rate

    need = sum(run_s(c) for c in dict.fromkeys([tuning.plan.pick.candidate, tuning.configured]))
    if left_s >= need:
        return
    used = budget_s - left_s
    enough = 10 * math.ceil((used + 2 * MIN_RUNS * need) / 10)
    raise ConfigError(
        "--budget-s",
        f"{budget_s:g} s leaves {max(left_s, 0):.1f} s for measured runs after {used:.1f} s of "
        f"stage and step measurements; measuring the model's pick and the scenario's setting "
        f"once each takes at least {need:.1f} s",
        f"give --budget-s {enough} or more (the default, {DEFAULT_BUDGET_S:g}, also searches "
        "the neighbours)",
    )


def search(
    tuning: Tuning,
    config,
    backend,
    device,
    window_s: float,
    deadline: float,
    on_device,
    other_ranks: companions.Companions | None = None,
):
    """Measured runs, from the model's pick: the pick and the scenario's own setting (for the
    speed-up), whatever the budget. Then a local search, one dimension at a time (the worker
    count first, then ring, prefetch, cache: model.DIMENSIONS): the untried steps from the
    fastest measured setting along the dimension, moving on while one is faster, for two thirds
    of the budget left; the model ranks the settings, the runs correct it where it misses a
    cost. Last, the settings within 10% of the fastest measured again in interleaved rounds
    until each has MIN_RUNS runs, so that a slow spell of a shared host does not choose, and the
    pick confirmed (:func:`confirm_pick`). ``other_ranks``: the node's other ranks, whose
    loaders run beside each measured run (verify.measure); each rate is then one rank's."""
    # Given to verify.measure only when there are other ranks: a one-rank run is called as ever.
    beside = {} if other_ranks is None else {"other_ranks": other_ranks}

    def run(candidate: model.Candidate) -> None:
        expected = tuning.predicted_rate(candidate)
        result = verify.measure(
            config, backend, candidate, device, window_s, expected, on_device=on_device, **beside
        )
        others = ", ".join(f"{rate:.0f}" for rate in result.other_ranks_samples_per_s)
        log.info(
            "%s: %.0f samples/s measured%s, %.0f predicted",
            candidate.label(),
            result.samples_per_s,
            f" (the other ranks beside it: {others})" if others else "",
            expected,
        )
        tuning.measured.append(result)

    climb_until = time.perf_counter() + 0.65 * (deadline - time.perf_counter())

    def time_left(until: float = deadline) -> bool:
        return time.perf_counter() < until

    feasible = [p for p in tuning.plan.predictions if p.feasible]
    for candidate in dict.fromkeys([tuning.plan.pick.candidate, tuning.configured]):
        run(candidate)
    current = tuning.plan.pick.candidate
    device_rate = tuning.target.batch_size / tuning.target.step_s
    if tuning.measured_rate(current) >= (1 - WITHIN) * device_rate:
        # The device is the limit: nothing runs faster; only fewer workers can be cheaper.
        while current.workers and time_left():
            fewer = model.normal(model.replace(current, workers=current.workers - 1))
            run(fewer)
            if tuning.measured_rate(fewer) < (1 - WITHIN) * device_rate:
                break
            current = fewer
        confirm_pick(tuning, run)
        return
    for dimension in model.DIMENSIONS:
        if not time_left(climb_until):
            tuning.unexplored.append(dimension)  # the report says the budget ended the search
        while time_left(climb_until):
            untried = [
                c for c in model.steps(current, dimension, feasible) if c not in tuning.rates()
            ]
            for candidate in sorted(untried, key=tuning.predicted_rate, reverse=True):
                if time_left(climb_until):
                    run(candidate)
            along = [current, *model.steps(current, dimension, feasible)]
            fastest = max((c for c in along if c in tuning.rates()), key=tuning.measured_rate)
            if fastest == current:
                break  # no step along this dimension is faster
            current = fastest
    best = max(tuning.measured_rate(c) for c in tuning.rates())
    contenders = sorted(
        (c for c in tuning.rates() if tuning.measured_rate(c) >= 0.9 * best),
        key=tuning.measured_rate,
        reverse=True,
    )[:3]
    # Interleaved rounds (A B C, C B A, ...) until each contender has MIN_RUNS runs: a slow
    # spell of a shared host then lands on all of them, and each gets an interval.
    round_number = 0
    while len(contenders) >= 2 and time_left():
        short = [c for c in contenders if len(tuning.rates()[c]) < MIN_RUNS]
        if not short:
            break
        for candidate in short if round_number % 2 else short[::-1]:
            if time_left():
                run(candidate)
        round_number += 1
    confirm_pick(tuning, run)


def confirm_pick(tuning: Tuning, run) -> None:
    """Never a pick on fewer than MIN_RUNS runs, nor against a fastest measured fewer times: the
    two are measured again, interleaved, past the deadline if need be (each run is a window of
    seconds; a pick on one run is a guess). A new run can change which is which: re-read."""
    for _ in range(2 * MIN_RUNS):
        pick, fastest = current_pick(tuning)
        short = [c for c in dict.fromkeys((pick, fastest)) if len(tuning.rates()[c]) < MIN_RUNS]
        if not short:
            return
        for candidate in short:
            run(candidate)


def choose(tuning: Tuning) -> None:
    """The cheapest measured setting as good as the fastest (:func:`as_good`: within WITHIN, or
    not measurably slower), and its bottleneck: the device when it ran at the device's rate,
    otherwise what the model says holds it."""
    pick, _ = current_pick(tuning)
    tuning.pick = pick
    device_rate = tuning.target.batch_size / tuning.target.step_s
    predicted = model.predict(tuning.costs, tuning.host, tuning.target, pick)
    if tuning.measured_rate(pick) >= (1 - WITHIN) * device_rate:
        tuning.bottleneck = model.GPU
    elif tuning.plan.bottleneck == model.SHM:
        tuning.bottleneck = model.SHM
    elif predicted.bottleneck == model.GPU:
        # The model expected the device to be the limit and the loader fell short of it: the
        # loader's own cost is what holds it (the model underestimated it): storage when its
        # reads wait longer than it computes, the CPU otherwise.
        waits = model.reads_wait_most(tuning.costs, tuning.host, tuning.target, pick)
        tuning.bottleneck = model.DISK if waits else model.CPU
    else:
        tuning.bottleneck = predicted.bottleneck
