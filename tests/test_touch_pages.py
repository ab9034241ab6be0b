"""`touch_pages`: weights mapped from a file are resident once the model is loaded.

Without it a mapped embedding becomes resident a row at a time, as tokens first appear, and
the engine's RSS creeps for hours under varied outputs (what the soak through `servefleet up`
caught); with it RSS is flat from the first request.
"""

from __future__ import annotations

from pathlib import Path

import torch

from servefleet.engine.memory import touch_pages

PAGES = 2048  # 8 MiB of 4 KiB pages


def mapped_rss_kib(path: Path) -> int:
    """Resident KiB of this process's mappings of `path` (from /proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and ":" not in fields[0]:
            inside = fields[-1] == str(path)
        elif inside and fields[0] == "Rss:":
            total += int(fields[1])
    return total


def test_every_page_of_a_mapped_weight_becomes_resident(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(range(256)) * (PAGES * 16))
    weight = torch.from_file(str(path), shared=True, size=PAGES * 1024, dtype=torch.float32)
    before = mapped_rss_kib(path)
    touch_pages(weight)
    after = mapped_rss_kib(path)
    assert before < PAGES * 4 // 4, before  # mapping reads nothing by itself
    assert after >= PAGES * 4, (before, after)  # every 4 KiB page, all 8 MiB


def test_a_strided_view_touches_its_whole_storage_and_odd_tensors_are_fine() -> None:
    base = torch.zeros(1000, 577)
    touch_pages(base[:, :5])
    touch_pages(torch.empty(0))
    touch_pages(torch.empty(3, device="meta"))
