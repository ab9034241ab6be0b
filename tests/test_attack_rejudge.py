"""The attack suite's second look (`attack_suite.rejudge_after_quiet`): when only the victim's
p99 failed, a quiet window just after the attack may excuse machine noise, never a slowdown
that outlasts the attack or one the second window does not explain."""

from __future__ import annotations

import pytest

from servefleet.bench import attack_suite
from servefleet.bench.attack_common import AttackResult, VictimFigures, judge_victim


def figures(p50: float, p99: float) -> VictimFigures:
    return VictimFigures(requests=30, p50_ms=p50, p99_ms=p99, not_ok={})


def judged(monkeypatch: pytest.MonkeyPatch, after: VictimFigures) -> AttackResult:
    before, attacked = figures(300, 700), figures(750, 1466)
    monkeypatch.setattr(attack_suite, "_window", lambda target, seconds, run: (after, None))
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
        "victim p50 700 ms after the attack vs 300 ms before it (> 2.0x): the stack did not recover"
    ]
