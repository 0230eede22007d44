"""The one kind of config error, always shown as one line with its fix."""

from __future__ import annotations

import re
from typing import Any


class ConfigError(ValueError):
    """A config problem, always shown as ONE line: `config error: <file>: <key>: <problem>. <hint>`.

    `source` is the file (or the --set item) that set the offending value; `key` its dotted path.
    """

    def __init__(self, key: str, problem: str, hint: str = "", source: str = ""):
        super().__init__(problem)
        self.key, self.problem, self.hint, self.source = key, problem, hint, source

    def __str__(self) -> str:
        parts = ["config error", *(part for part in (self.source, self.key) if part)]
        text = ": ".join([*parts, sentence(self.problem)])
        if self.hint:
            text += " " + sentence(self.hint[0].upper() + self.hint[1:])
        return re.sub(r"\s*\n\s*", " ", text)  # YAML messages carry newlines; logs want one line


def sentence(text: str) -> str:
    return text if text.endswith((".", "?", "!")) else text + "."


def show(value: Any) -> str:
    shown = repr(value)
    return (
        f"{shown[:60]}... ({type(value).__name__})"
        if len(shown) > 60
        else f"{shown} ({type(value).__name__})"
    )
