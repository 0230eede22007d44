"""Task metrics in numpy, shared by both backends (framework-free)."""

from __future__ import annotations

import numpy as np


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

    def __init__(self) -> None:
        self.correct = 0
        self.total = 0
        self.norm_edit_sum = 0.0

    def update(self, predicted_classes: np.ndarray, labels: np.ndarray, lengths: np.ndarray):
        for predicted, label, length in zip(ctc_greedy_decode(predicted_classes), labels, lengths):
            target = [int(c) for c in label[: int(length)]]
            self.correct += predicted == target
            self.norm_edit_sum += edit_distance(predicted, target) / max(
                len(predicted), len(target), 1
            )
            self.total += 1

    def state(self) -> np.ndarray:
        return np.array([self.correct, self.total, self.norm_edit_sum], dtype=np.float64)

    @staticmethod
    def summarize(state: np.ndarray) -> dict[str, float]:
        correct, total, norm_edit = state
        total = max(total, 1.0)
        return {"acc": correct / total, "norm_edit_dis": 1.0 - norm_edit / total}


class TopKMetric:
    def __init__(self) -> None:
        self.top1 = 0
        self.top5 = 0
        self.total = 0

    def update(self, top5: np.ndarray, labels: np.ndarray) -> None:
        top5 = np.asarray(top5)
        labels = np.asarray(labels).reshape(-1, 1)
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
