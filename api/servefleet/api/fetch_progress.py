"""The lines the model fetch init container logs, and how the operator reads them back.

The init container's log is the one channel from a download to the LLMDeployment's
`ModelLoading` condition: a person reads the same lines with `kubectl logs`, and the
operator reads the last one (`pods/log`), so engine pods need no API access at all.
Each line is plain text for people, ending in `[done=N total=M]` for the operator.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

FETCH_CONTAINER = "model-fetch"
"""Name of the init container that downloads the model into the cache."""

FetchState = Literal["progress", "done", "failed"]

_LINE = re.compile(
    r"^model fetch (?P<state>progress|done|failed): (?P<text>.*?)"
    r"(?: \[done=(?P<done>\d+) total=(?P<total>\d+|\?)\])?$"
)


class FetchProgress(BaseModel):
    """One report of a download: bytes so far, or how it ended."""

    model_config = ConfigDict(frozen=True)

    state: FetchState
    done_bytes: int = Field(default=0, ge=0)
    total_bytes: int | None = Field(default=None, ge=0, description="None while unknown.")
    message: str = Field(default="", description="What a person reads: sizes, or the cause.")

    def line(self) -> str:
        """The log line (one line: newlines in a cause are flattened)."""
        text = " ".join(self.message.split())
        if self.state == "failed":
            return f"model fetch failed: {text}"
        total = "?" if self.total_bytes is None else str(self.total_bytes)
        return f"model fetch {self.state}: {text} [done={self.done_bytes} total={total}]"

    def summary(self) -> str:
        """Bytes done/total for a condition message: '1.2 GiB of 15.0 GiB (8%)'."""
        if self.total_bytes is None:
            return f"{human_bytes(self.done_bytes)} so far"
        share = 100 * self.done_bytes // self.total_bytes if self.total_bytes else 100
        return f"{human_bytes(self.done_bytes)} of {human_bytes(self.total_bytes)} ({share}%)"


def parse_line(line: str) -> FetchProgress | None:
    """A logged line back into a report; None for any other line."""
    match = _LINE.match(line.strip())
    if match is None:
        return None
    total = match["total"]
    return FetchProgress(
        state=match["state"],  # type: ignore[arg-type]  # the regex allows only the three
        done_bytes=int(match["done"] or 0),
        total_bytes=None if total in (None, "?") else int(total),
        message=match["text"],
    )


def last_report(log: str) -> FetchProgress | None:
    """The newest report in a log tail."""
    for line in reversed(log.splitlines()):
        if (report := parse_line(line)) is not None:
            return report
    return None


def human_bytes(count: int) -> str:
    """1288490188 -> '1.2 GiB'."""
    size = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"  # pragma: no cover - the loop always returns
