"""One line of the doctor's report: what was checked, PASS/WARN/FAIL, what was found, the fix.

Its own module so that the doctor (train/doctor.py) and its GPU checks
(train/backends/gpu_verdicts.py), which the doctor imports, share it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Check:
    name: str
    status: str  # PASS | WARN | FAIL
    detail: str
    fix: str = ""
