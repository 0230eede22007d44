"""Task metrics in numpy, shared by both backends (framework-free).

A metric accumulates over the batches of one evaluation (``update`` with the backend's
predictions and the batch's label fields), hands its sums to the all-reduce over ranks
(``state``), and turns the reduced sums into figures (``summarize``).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np


class Metric(Protocol):
    main: str  # the summary's key that picks the best checkpoint (higher is better)

    def update(self, predicted: np.ndarray, labels: dict[str, np.ndarray]) -> None: ...
    def state(self) -> np.ndarray: ...
    @staticmethod
    def summarize(state: np.ndarray) -> dict[str, float]: ...


class Breakdown(Protocol):
    """A figure train.evaluate reports beside the metric's (Task.breakdowns): accumulated over
    one evaluation in one process, never reduced over ranks."""

    def update(self, predicted: np.ndarray, labels: dict[str, np.ndarray]) -> None: ...
    def summarize(self) -> dict: ...


def ctc_greedy_decode(classes: np.ndarray) -> list[list[int]]:
    """Best-path CTC decoding: per row, merge repeated classes, then drop blanks (class 0)."""
    decoded = []
    for row in np.asarray(classes):
        keep = np.ones(len(row), dtype=bool)
        keep[1:] = row[1:] != row[:-1]
        decoded.append([int(c) for c in row[keep] if c != 0])
    return decoded


def edit_distance(a: list[int] | str, b: list[int] | str) -> int:
    """Levenshtein distance with one row of memory."""
    previous = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        current = [i]
        for j, y in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (x != y)))
        previous = current
    return previous[-1]


class OcrMetric:
    """Exact-match accuracy and 1 - normalized edit distance (PaddleOCR's norm_edit_dis)."""

    main = "acc"  # the figure that picks the run's best checkpoint (higher is better)

    def __init__(self) -> None:
        self.correct = 0
        self.total = 0
        self.norm_edit_sum = 0.0

    def update(self, predicted: np.ndarray, labels: dict[str, np.ndarray]) -> None:
        """``predicted``: class per time step [N, T]; labels: "label" [N, L], "length" [N]."""
        rows = zip(ctc_greedy_decode(predicted), labels["label"], labels["length"])
        for decoded, label, length in rows:
            target = [int(c) for c in label[: int(length)]]
            self.correct += decoded == target
            self.norm_edit_sum += edit_distance(decoded, target) / max(len(decoded), len(target), 1)
            self.total += 1

    def state(self) -> np.ndarray:
        return np.array([self.correct, self.total, self.norm_edit_sum], dtype=np.float64)

    @staticmethod
    def summarize(state: np.ndarray) -> dict[str, float]:
        correct, total, norm_edit = state
        total = max(total, 1.0)
        return {"acc": correct / total, "norm_edit_dis": 1.0 - norm_edit / total}


class TopKMetric:
    """Top-1 and top-5 accuracy."""

    main = "top1"  # the figure that picks the run's best checkpoint (higher is better)

    def __init__(self) -> None:
        self.top1 = 0
        self.top5 = 0
        self.total = 0

    def update(self, predicted: np.ndarray, labels: dict[str, np.ndarray]) -> None:
        """``predicted``: the top-5 class ids [N, 5], best first; labels: "label" [N]."""
        top5 = np.asarray(predicted)
        labels = np.asarray(labels["label"]).reshape(-1, 1)
        self.top1 += int((top5[:, :1] == labels).sum())
        self.top5 += int((top5 == labels).any(axis=1).sum())
        self.total += len(labels)

    def state(self) -> np.ndarray:
        return np.array([self.top1, self.top5, self.total], dtype=np.float64)

    @staticmethod
    def summarize(state: np.ndarray) -> dict[str, float]:
        top1, top5, total = state
        total = max(total, 1.0)
        return {"top1": top1 / total, "top5": top5 / total}


class MultiLabelMetric:
    """Exact match (the predicted tag set is the true one) and micro-averaged F1 over every
    (image, tag) decision: exact match is strict, F1 credits partly right sets."""

    main = "exact_match"  # the figure that picks the run's best checkpoint (higher is better)

    def __init__(self) -> None:
        self.counts = np.zeros(5, dtype=np.float64)  # exact, total, true/false pos., false neg.

    def update(self, predicted: np.ndarray, labels: dict[str, np.ndarray]) -> None:
        """``predicted``: multi-hot [N, tags] (0 or 1); labels: "label" multi-hot [N, tags]."""
        got = np.asarray(predicted) > 0
        truth = np.asarray(labels["label"]) > 0.5
        self.counts += [
            (got == truth).all(axis=1).sum(),
            len(truth),
            (got & truth).sum(),
            (got & ~truth).sum(),
            (~got & truth).sum(),
        ]

    def state(self) -> np.ndarray:
        return self.counts.copy()

    @staticmethod
    def summarize(state: np.ndarray) -> dict[str, float]:
        exact, total, true_pos, false_pos, false_neg = state
        decided = 2 * true_pos + false_pos + false_neg
        # No tag predicted and none true: every decision was right.
        f1 = 2 * true_pos / decided if decided else 1.0
        return {"exact_match": exact / max(total, 1.0), "f1": f1}


class OcrLengthAccuracy:
    """Exact-match accuracy by label length (train.evaluate's breakdown; not reduced over
    ranks: evaluation there runs in one process)."""

    def __init__(self) -> None:
        self.counts: dict[int, list[int]] = {}  # length -> [correct, total]

    def update(self, predicted: np.ndarray, labels: dict[str, np.ndarray]) -> None:
        rows = zip(ctc_greedy_decode(predicted), labels["label"], labels["length"])
        for decoded, label, length in rows:
            target = [int(c) for c in label[: int(length)]]
            counts = self.counts.setdefault(int(length), [0, 0])
            counts[0] += decoded == target
            counts[1] += 1

    def summarize(self) -> dict[str, dict[str, float]]:
        return {
            str(length): {"acc": correct / total, "samples": total}
            for length, (correct, total) in sorted(self.counts.items())
        }
