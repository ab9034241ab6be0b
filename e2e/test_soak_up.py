"""The `servefleet up` soak, short (`servefleet.bench.soak_up`; the long one is `make soak-up`):
the built-in model behind the local plane, mixed load from two tenants, every process watched.

Over a minute RSS slopes and fd counts are noise, so only what cannot be is asserted: nothing
hung, failed or answered 5xx, the engines hand every KV block back at idle, and Ctrl-C stops
`servefleet up` and all its children. Slow (it loads the model twice): run it on its own,
    uv run pytest e2e/test_soak_up.py -s
"""

from __future__ import annotations

from pathlib import Path

from servefleet.bench.fault_load import Outcome
from servefleet.bench.soak_up import SoakOptions, run_soak, write
from servefleet.bench.soak_up_probe import ENGINE_PREFIX, UP_LABEL


def test_a_short_soak_through_servefleet_up_loses_nothing(tmp_path: Path) -> None:
    options = SoakOptions(minutes=0.75, progress_s=15, out=tmp_path / "soak_up")
    report, samples = run_soak(options, tmp_path)
    write(report, samples, options.out)
    shown = report.model_dump_json(indent=1, exclude={"series"})
    assert report.outcomes[Outcome.OK.value] > 0, shown
    for bad in (Outcome.HUNG, Outcome.FAILED, Outcome.ERROR_EVENT, Outcome.REFUSED_BARE):
        assert report.outcomes[bad.value] == 0, shown
    assert report.server_errors == 0, shown
    assert report.seconds_to_kv_idle is not None, shown
    assert report.kv_usage_at_idle and not any(report.kv_usage_at_idle.values()), shown
    assert len(report.kv_usage_at_idle) == options.replicas == 2, shown
    assert report.up_exit_code == 0 and not report.left_running, shown
    labels = [p.label for p in report.processes]
    assert UP_LABEL in labels, shown
    assert len([label for label in labels if label.startswith(ENGINE_PREFIX)]) == 2, shown
    assert (options.out / "soak_up.png").is_file()
