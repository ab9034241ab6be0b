"""The attack suite's second look (`attack_suite.rejudge_after_quiet`): when only the victim's
p99 failed, a quiet window just after the attack may excuse machine noise, never a slowdown
that outlasts the attack or one the second window does not explain."""

from __future__ import annotations

import pytest

from servefleet.bench import attack_suite
from servefleet.bench.attack_common import AttackResult, VictimFigures, judge_victim


def figures(p50: float, p99: float) -> VictimFigures:
    return VictimFigures(requests=30, p50_ms=p50, p99_ms=p99, not_ok={})


def judged(monkeypatch: pytest.MonkeyPatch, *afters: VictimFigures) -> AttackResult:
    """Judged again after quiet windows that measure `afters`, one after another (the last
    one again if more are asked for)."""
    before, attacked = figures(300, 700), figures(750, 1466)
    measured = iter(afters)
    monkeypatch.setattr(
        attack_suite, "_window", lambda target, seconds, run: (next(measured, afters[-1]), None)
    )
    result = AttackResult("budget_self_raise", "a test")
    judge_victim(result, before, attacked)
    assert result.violations == ["victim p99 1466 ms under attack vs 700 ms quiet (2.09x > 2.0x)"]
    target = attack_suite.Target(stack=None, url="", victim="", probes={})
    attack_suite.rejudge_after_quiet(result, target, before, attacked)
    return result


def test_a_slower_quiet_window_after_excuses_the_p99(monkeypatch: pytest.MonkeyPatch) -> None:
    result = judged(monkeypatch, figures(320, 900))
    assert result.violations == []
    assert result.victim["quiet_p99_ms"] == 900
    assert result.victim["first_judgement"]["quiet_p99_ms"] == 700


def test_an_equally_quiet_window_after_keeps_the_violation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    result = judged(monkeypatch, figures(290, 650))
    assert result.violations == ["victim p99 1466 ms under attack vs 700 ms quiet (2.09x > 2.0x)"]


def test_a_slowdown_that_outlasts_the_attack_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    result = judged(monkeypatch, figures(700, 1500))
    assert result.violations == [
        "victim p50 700 ms 30 s after the attack vs 300 ms before it (> 2.0x): "
        "the stack did not recover"
    ]
    assert result.victim["quiet_after_p50_ms"] == [700, 700, 700]


def test_a_median_that_recovers_in_a_later_window_passes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first window after fell on other tests' busiest moment (CI: 941 ms against 363),
    the second found the stack as before the attack."""
    result = judged(monkeypatch, figures(941, 2285), figures(320, 650))
    assert result.violations == []
    assert result.victim["quiet_after_p50_ms"] == [941, 320]
    assert result.victim["quiet_p99_ms"] == 2285
