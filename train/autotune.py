"""The loader tuned while the run trains (``loader.autotune.enabled``), framework-free.

The offline tuner (``python -m train.tune``) measures a host before a run; this one watches the
run itself, as tf.data's AUTOTUNE does: the training loop's own steps, in windows of
``loader.autotune.window_steps`` steps after the workers' first round of batches, each window's
samples/s and the share of its wall time the trainer waited for data. Between two steps it
rebuilds the training loader at another setting; the sampler goes on from the epoch's position
(as ``--resume`` does), and a sample's augmentation depends on the seed, the epoch and the sample
only, so the batches, and the run, are the same whatever the setting and wherever it changes.

How it moves (:class:`Climb`, pure):
- a window whose data wait is under ``keeps_up_wait`` means the loader keeps up: it stays;
- from 0 workers it jumps to the workers that the window says keep up (the batch's load time in
  the trainer over the rest of a step: each worker makes one batch while the step runs that
  many), at most a worker per core, then climbs;
- a worker more while that beats the current setting by ``min_gain`` (up to twice the cores, at
  most train.cpus.MAX_USEFUL_WORKERS); when the first one more does not, a worker fewer while
  that is as good (within ``min_gain``): fewer processes for the same rate;
- then the next deeper prefetch, kept only if it beats the current setting by ``min_gain``;
- then, when the scenario has no record cache, a memory cache (datasets/cache.py: the records
  as storage returns them, in /dev/shm): what workers hide of a read's wait they pay for in
  processes (and, with a CPU step, in the step's cores), and a cache removes the read. It is
  attached at the next epoch's start; that epoch fills it and is not measured; the epoch after
  finds its best worker count (a worker fewer while that is as fast, down to none), which is
  kept only if it beats the best setting without the cache by ``min_gain``; otherwise the cache
  is removed at the following epoch's start. Not
  a disk cache: the page cache already keeps a dataset that fits in memory, and one that does
  not is read from the same disk either way;
- settled, it keeps watching: three windows in a row above train.stall_warn_fraction (the data
  slowed down: another job on the host, colder storage) start the climb again.
A setting whose batches (and cache) would not fit the free /dev/shm (train/preflight.py's plan)
is skipped.

Each change is logged with its reason. Rank 0 writes ``autotune.json`` in the run directory at
each change (a resumed run starts from it) and ``tuned.yaml`` when the climb settles: the
scenario it ran, extended with the settings it chose, for the next run. Each rank tunes its own
loader from its own windows (they share the node's cores alike); ranks keep their steps in
lockstep through the gradient all-reduce, so their windows see the same rates.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from datasets.safe_files import write_atomic
from train import preflight
from train.cpus import MAX_USEFUL_WORKERS, usable_cores
from train.device_wait import DEVICE_WAITS

log = logging.getLogger("train")

STATE_FILE = "autotune.json"
TUNED_FILE = "tuned.yaml"
PREFETCH_CHOICES = (1, 2, 4)  # the depths the climb tries, as the offline tuner's grid
CACHES = ("none", "memory", "disk")
DRIFT_WINDOWS = 3  # settled, this many windows in a row above the stall share start a new climb


@dataclass(frozen=True)
class Setting:
    workers: int
    prefetch: int  # batches in flight per worker (kept as configured at 0 workers)
    cache: str = "none"  # data.cache: none, or memory (the one the climb tries)

    def label(self) -> str:
        text = f"num_workers={self.workers}"
        if self.workers:
            text += f" prefetch_factor={self.prefetch}"
        return text + (f" cache={self.cache}" if self.cache != "none" else "")

    def as_dict(self) -> dict:
        return {"num_workers": self.workers, "prefetch_factor": self.prefetch, "cache": self.cache}

    def knobs(self) -> dict:
        """The config sections' keys for this setting (no prefetch without workers)."""
        prefetch = self.prefetch if self.workers else None
        loader = {"num_workers": self.workers, "prefetch_factor": prefetch}
        return {"loader": loader, "data": {"cache": self.cache}}

    @classmethod
    def of(cls, saved: dict) -> Setting:
        """From :meth:`as_dict`'s keys (autotune.json)."""
        cache = str(saved.get("cache", "none"))
        if cache not in CACHES:
            raise ValueError(f"unknown cache {cache!r}")
        return cls(int(saved["num_workers"]), int(saved["prefetch_factor"]), cache)


@dataclass(frozen=True)
class Window:
    """``steps`` training steps at ``setting``: their wall time and the trainer's data wait."""

    setting: Setting
    steps: int
    samples: int
    wall_s: float
    wait_s: float

    @property
    def samples_per_s(self) -> float:
        return self.samples / max(self.wall_s, 1e-9)

    @property
    def wait_fraction(self) -> float:
        return min(1.0, self.wait_s / max(self.wall_s, 1e-9))


@dataclass
class Climb:
    """Which setting to run next, from the windows measured so far (see the module's doc)."""

    start: Setting
    cores: int  # this rank's share of the usable cores
    keeps_up_wait: float
    min_gain: float
    stall_wait: float  # train.stall_warn_fraction: settled, waits above it mean drift
    fits: object = None  # (Setting) -> bool: its batches fit the free /dev/shm
    try_cache: bool = False  # the scenario has no record cache: the climb may try one
    current: Setting = field(init=False)
    incumbent: Setting = field(init=False)  # the best setting so far
    phase: str = "start"  # start, jump, more, fewer, prefetch, cache, cached, settled
    rates: dict = field(default_factory=dict)  # Setting -> [samples/s of its windows]
    moved_up: bool = False  # this climb kept a worker more
    before_cache: Setting | None = None  # the best setting without the cache it is judged by
    drift: int = 0  # settled: windows in a row above the stall share

    def __post_init__(self) -> None:
        self.current = self.incumbent = self.start

    @property
    def top_workers(self) -> int:
        return min(MAX_USEFUL_WORKERS, 2 * self.cores)

    def rate(self, setting: Setting) -> float:
        return statistics.median(self.rates[setting])

    def observe(self, window: Window) -> tuple[Setting | None, str]:
        """The window just measured at the current setting: (the setting to run next, None to
        stay; why)."""
        self.rates.setdefault(window.setting, []).append(window.samples_per_s)
        if self.phase == "settled":
            return self._watch(window)
        if self.phase == "start":
            return self._from_start(window)
        trial, incumbent = self.current, self.incumbent
        gain = self.rate(trial) / self.rate(incumbent) - 1
        versus = f"{self.rate(trial):.0f} vs {self.rate(incumbent):.0f} samples/s ({gain:+.0%})"
        if self.phase == "cache":
            # Reads from memory: the cached setting's best worker count is found before the
            # cache is judged (on a CPU host its gain is often the cores that workers give back
            # to the step, not a faster loader at the same workers).
            self.incumbent = trial
            return self._next_fewer(f"{trial.label()}: {self.rate(trial):.0f} samples/s", "cached")
        if self.phase in ("jump", "more", "prefetch") and gain > self.min_gain:
            self.incumbent = trial
            self.moved_up = self.moved_up or self.phase in ("jump", "more")
            faster = f"{trial.label()} is faster: {versus}"
            if window.wait_fraction < self.keeps_up_wait or self.phase == "prefetch":
                return self._next_cache(faster)
            return self._next_more(faster)
        if self.phase in ("fewer", "cached") and gain >= -self.min_gain:
            self.incumbent = trial
            why = f"{trial.label()} is as fast or faster with fewer workers: {versus}"
            return self._next_fewer(why, phase=self.phase)
        # The trial lost: the next move starts from the incumbent.
        why = f"{trial.label()} is not faster than {incumbent.label()}: {versus}"
        if self.phase in ("jump", "more") and not self.moved_up and incumbent.workers > 1:
            return self._next_fewer(why)
        if self.phase in ("jump", "more", "fewer"):
            return self._next_prefetch(why)
        if self.phase == "prefetch":
            return self._next_cache(why)
        return self._judge_cache(why)  # phase "cached": a worker fewer with the cache lost

    def _from_start(self, window: Window) -> tuple[Setting | None, str]:
        start = self.current
        waited = f"{window.wait_fraction:.0%} of the step time waiting for data"
        if window.wait_fraction < self.keeps_up_wait:
            return self._settle(f"{start.label()} keeps up: {waited}")
        if start.workers == 0:
            # The trainer loaded each batch itself: its wait is a batch's load time, the rest
            # of the step is the step. A worker makes a batch while `needed` steps run.
            per_step = window.wall_s / window.steps
            load = window.wait_s / window.steps
            needed = math.ceil(load / max(per_step - load, 1e-6))
            workers = max(1, min(needed, self.cores))
            jump = dataclasses.replace(start, workers=workers, prefetch=max(start.prefetch, 2))
            return self._try(jump, "jump", f"{start.label()}: {waited}")
        return self._next_more(f"{start.label()}: {waited}")

    def _next_more(self, why: str) -> tuple[Setting | None, str]:
        more = dataclasses.replace(self.incumbent, workers=self.incumbent.workers + 1)
        if more.workers <= self.top_workers and self._fits(more):
            return self._try(more, "more", why)
        return self._next_prefetch(why)

    def _next_fewer(self, why: str, phase: str = "fewer") -> tuple[Setting | None, str]:
        """A worker fewer; ``cached``: with the cache, down to none (reads from memory may need
        no worker), then the cache is judged."""
        fewer = dataclasses.replace(self.incumbent, workers=self.incumbent.workers - 1)
        if fewer.workers >= (0 if phase == "cached" else 1):
            return self._try(fewer, phase, why)
        if phase == "cached":
            return self._judge_cache(why)
        return self._next_prefetch(why)

    def _judge_cache(self, why: str) -> tuple[Setting | None, str]:
        """The best cached setting against the best without the cache: kept only when it beats
        it by ``min_gain`` (a cache holds /dev/shm and memory); otherwise the setting without
        it, and the cache goes at the next epoch's start."""
        cached, plain = self.incumbent, self.before_cache
        gain = self.rate(cached) / self.rate(plain) - 1
        versus = f"{self.rate(cached):.0f} vs {self.rate(plain):.0f} samples/s ({gain:+.0%})"
        if gain > self.min_gain:
            return self._settle(
                f"{why}; the cache pays: {cached.label()} against {plain.label()}: {versus}"
            )
        self.incumbent = plain
        return self._settle(
            f"{why}; the cache does not pay: {cached.label()} against {plain.label()}: {versus}"
        )

    def _next_prefetch(self, why: str) -> tuple[Setting | None, str]:
        deeper = [p for p in PREFETCH_CHOICES if p > self.incumbent.prefetch]
        if self.incumbent.workers and deeper:
            candidate = dataclasses.replace(self.incumbent, prefetch=deeper[0])
            if self._fits(candidate):
                return self._try(candidate, "prefetch", why)
        return self._next_cache(why)

    def _next_cache(self, why: str) -> tuple[Setting | None, str]:
        """A memory cache, once more workers and prefetch are done: the climb started because
        the loader waited for data, and what workers hide of a read's wait they pay for in
        processes (and, with a CPU step, in the step's cores); a cache removes the read."""
        if self.try_cache and self.incumbent.cache == "none":
            cached = dataclasses.replace(self.incumbent, cache="memory")
            if self._fits(cached):
                self.before_cache = self.incumbent
                return self._try(cached, "cache", why)
        return self._settle(why)

    def _try(self, setting: Setting, phase: str, why: str) -> tuple[Setting | None, str]:
        self.phase = phase
        return self._run(setting, f"{why}; trying {setting.label()}")

    def _settle(self, why: str) -> tuple[Setting | None, str]:
        self.phase, self.drift = "settled", 0
        return self._run(self.incumbent, f"{why}; settled on {self.incumbent.label()}")

    def _run(self, setting: Setting, why: str) -> tuple[Setting | None, str]:
        changed = setting != self.current
        self.current = setting
        return (setting if changed else None), why

    def _watch(self, window: Window) -> tuple[Setting | None, str]:
        self.drift = self.drift + 1 if window.wait_fraction > self.stall_wait else 0
        if self.drift < DRIFT_WINDOWS:
            return None, ""
        self.rates = {}  # the old rates are from before the data slowed down
        self.rates[window.setting] = [window.samples_per_s]
        self.moved_up = False
        return self._next_more(
            f"{DRIFT_WINDOWS} windows in a row waited over {self.stall_wait:.0%} of the step "
            f"time for data ({window.wait_fraction:.0%} the last)"
        )

    def _fits(self, setting: Setting) -> bool:
        return self.fits is None or self.fits(setting)

    @property
    def settled(self) -> bool:
        return self.phase == "settled"


class LoaderAutotune:
    """The run's side: times the windows in the stream of training batches, asks the climb,
    and says when the loop must rebuild its loader: between two steps for the workers and the
    prefetch (``switch_to``), at an epoch's start for the cache (:meth:`epoch_started`).
    Disabled, it passes the batches through."""

    def __init__(
        self, config, run_dir: Path, is_main: bool, local_ranks: int, resume: bool, source=None
    ):
        """``resume``: start where the resumed run's tuning had got to (its autotune.json);
        ``source``: (the scenario's path, its --set overrides) as the command line gave them,
        for tuned.yaml; None: tuned.yaml extends the run's own config.resolved.yaml."""
        self.config, self.run_dir, self.is_main = config, Path(run_dir), is_main
        self.cfg = config.loader.autotune
        self.enabled = self.cfg.enabled
        self.local_ranks, self.source = local_ranks, source
        loader = config.loader
        start = Setting(loader.num_workers, loader.prefetch_factor, config.data.cache)
        self.changes: list[dict] = []
        self.first: Window | None = None  # the first window kept: the start's rate
        # The run's first window is not kept: the model's first steps allocate its memory and
        # choose its kernels, and would read the start setting slower than it is.
        self.model_warm = True
        self.switch_to: Setting | None = None
        # A cache change waits for the next epoch's start (then the epoch fills the cache, and
        # its windows are not measured: ``fill_epoch``).
        self.pending: Setting | None = None
        self.fill_epoch: int | None = None
        saved = self._saved_state() if self.enabled and resume else None
        config_cache = start.cache
        if saved is not None:
            start = Setting.of(saved["setting"])
            self.changes = saved.get("changes", [])
        # What the loader runs now; the resumed setting's cache is attached at the first epoch.
        self.running = dataclasses.replace(start, cache=config_cache)
        if start.cache != config_cache:
            self.pending = start
        self.climb = Climb(
            start,
            cores=max(1, usable_cores() // max(1, local_ranks)),
            keeps_up_wait=self.cfg.keeps_up_wait,
            min_gain=self.cfg.min_gain,
            stall_wait=config.train.stall_warn_fraction,
            fits=self._fits,
            try_cache=config_cache == "none",
        )
        if saved is not None and saved.get("settled"):
            self.climb.phase = "settled"

    @property
    def setting(self) -> Setting:
        """The setting the training loader runs."""
        return self.running

    def loader_config(self, loader_cfg):
        """``loader_cfg`` at the current setting."""
        setting = self.setting
        return dataclasses.replace(
            loader_cfg, num_workers=setting.workers, prefetch_factor=setting.prefetch
        )

    def epoch_started(self, epoch: int) -> Setting | None:
        """At an epoch's start: the setting whose cache the loop must attach (or remove) now,
        with a new loader (None: nothing changes). The epoch that fills a new cache is not
        measured."""
        if self.pending is None:
            return None
        self.running, self.pending = self.pending, None
        self.fill_epoch = epoch if self.running.cache != "none" else None
        log.info("loader autotune: epoch %d runs at %s", epoch, self.running.label())
        return self.running

    def watch(self, batches, synchronize, epoch: int):
        """Yield ``batches`` (this epoch's, from the current loader), timing windows between
        the steps; return early, with ``switch_to`` set, when the next window should run at
        another setting. ``synchronize``: waits for the queued steps (read at a window's ends
        while the climb measures, so that a window's wall time is its steps'). Not measured:
        an epoch that fills a new cache, and the rest of an epoch after which the cache
        changes."""
        self.switch_to = None
        if not self.enabled or self.pending is not None or epoch == self.fill_epoch:
            yield from batches
            return
        batch_size = self.config.loader.batch_size
        warm = self.setting.workers + 1  # the new workers' first round arrives together
        taken, start, waited = 0, 0.0, 0.0
        iterator = iter(batches)
        while True:
            if taken == warm or (taken > warm and (taken - warm) % self.cfg.window_steps == 0):
                if not self.climb.settled:
                    synchronize()
                now = time.perf_counter()
                if taken > warm:
                    steps = self.cfg.window_steps
                    window = Window(self.setting, steps, steps * batch_size, now - start, waited)
                    if self._observe(window):
                        return
                    if self.pending is not None:  # a cache change: at the next epoch
                        yield from iterator
                        return
                start, waited = time.perf_counter(), 0.0
            began, device_wait = time.perf_counter(), DEVICE_WAITS.wall_s
            try:
                batch = next(iterator)
            except StopIteration:
                return
            # The device holding the loader's hand-over back is not waiting for data.
            waited += time.perf_counter() - began - (DEVICE_WAITS.wall_s - device_wait)
            taken += 1
            yield batch

    def _observe(self, window: Window) -> bool:
        """Feed the climb; True when the loop must switch the loader."""
        if self.model_warm:
            self.model_warm = False
            return False
        if self.first is None:
            self.first = window
        was_settled = self.climb.settled
        following, why = self.climb.observe(window)
        if why and not (was_settled and self.climb.settled):
            log.info(
                "loader autotune: %s: %.0f samples/s, %.0f%% waiting for data. %s",
                window.setting.label(),
                window.samples_per_s,
                100 * window.wait_fraction,
                why,
            )
        if following is None:
            if self.climb.settled and not was_settled:
                self._record(window, why, self.running)
            return False
        self._record(window, why, following)
        if following.cache != self.running.cache:
            self.pending = following
            return False
        self.switch_to = self.running = following
        return True

    def _record(self, window: Window, why: str, following: Setting) -> None:
        """The change (or the settling) in the log of changes, and in autotune.json: where a
        resumed run starts (a cache change pending is saved as its target)."""
        self.changes.append(
            {
                "from": window.setting.as_dict(),
                "to": following.as_dict(),
                "samples_per_s": round(window.samples_per_s, 1),
                "data_wait_fraction": round(window.wait_fraction, 4),
                "why": why,
            }
        )
        if self.is_main:
            state = {
                "setting": following.as_dict(),
                "settled": self.climb.settled,
                "changes": self.changes,
            }
            write_atomic(self.run_dir / STATE_FILE, json.dumps(state, indent=2))
            if self.climb.settled:
                write_atomic(self.run_dir / TUNED_FILE, self._tuned_yaml(following))

    def _saved_state(self) -> dict | None:
        """autotune.json of the run being resumed (None: a new run, or none written)."""
        path = self.run_dir / STATE_FILE
        try:
            state = json.loads(path.read_text())
            setting = Setting.of(state["setting"])
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as error:
            log.warning(
                "loader autotune: %s is unreadable (%s): starting from the config", path, error
            )
            return None
        log.info("loader autotune: resuming at %s", setting.label())
        return state

    def _fits(self, setting: Setting) -> bool:
        """The setting's /dev/shm need fits what is free plus what the current setting holds
        (it is released before the new loader starts)."""

        def need(s: Setting) -> int:
            loader = dataclasses.replace(
                self.config.loader, num_workers=s.workers, prefetch_factor=s.prefetch
            )
            data = dataclasses.replace(self.config.data, cache=s.cache)
            config = dataclasses.replace(self.config, loader=loader, data=data)
            return preflight.plan(config, self.local_ranks).need_bytes

        room = preflight.shm_free_bytes() + need(self.setting)
        if need(setting) <= room:
            return True
        log.info("loader autotune: %s skipped: its batches do not fit /dev/shm", setting.label())
        return False

    def _tuned_yaml(self, settled: Setting) -> str:
        from train.config.load import RESOLVED_NAME, deep_merge, overrides_mapping

        if self.source is not None:
            scenario, overrides = str(self.source[0]), overrides_mapping(self.source[1])
        else:
            scenario, overrides = str((self.run_dir / RESOLVED_NAME).resolve()), {}
        body = deep_merge(overrides, settled.knobs())
        start, when = self.first, time.strftime("%Y-%m-%d %H:%M")
        rated = f"{settled.label()}: {self.climb.rate(settled):.0f} samples/s per rank"
        if start is not None:
            rated += f" (the start, {start.setting.label()}: {start.samples_per_s:.0f})"
        header = [
            f"# Written by loader.autotune in the run {self.run_dir}, on {platform.node()}, "
            f"{when}: {usable_cores()} cores, {self.local_ranks} rank(s).",
            f"# Settled on {rated}.",
            f"# Train with: python -m train --config {self.run_dir / TUNED_FILE}",
        ]
        text = yaml.safe_dump({"extends": scenario, **body}, sort_keys=False)
        return "\n".join(header) + "\n" + text

    def summary(self) -> dict:
        """The run summary's keys (none when disabled)."""
        if not self.enabled:
            return {}
        rates = self.climb.rates.get(self.climb.incumbent)
        return {
            "autotune_setting": self.climb.incumbent.label(),
            "autotune_settled": self.climb.settled,
            "autotune_samples_per_s": round(statistics.median(rates), 1) if rates else None,
            "autotune_start_samples_per_s": (
                round(self.first.samples_per_s, 1) if self.first is not None else None
            ),
            "autotune_changes": len(self.changes),
        }
