"""One log shape for every role: logfmt by default, one JSON object per line by flag."""

from __future__ import annotations

import json
import logging
import shlex

import pytest

from servefleet.cli.logs import setup_logging


@pytest.fixture(autouse=True)
def _restore_root_logger():  # type: ignore[no-untyped-def]
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def _emit(capsys: pytest.CaptureFixture[str], log_format: str) -> list[str]:
    setup_logging("info", log_format)
    log = logging.getLogger("servefleet.test")
    log.debug("hidden below the level")
    log.info("ready: url=%s", "http://127.0.0.1:8000", extra={"replica": "tiny-0"})
    try:
        raise ValueError("bad")
    except ValueError:
        log.exception("failed")
    return capsys.readouterr().err.splitlines()


def test_text_is_logfmt_with_extra_fields(capsys: pytest.CaptureFixture[str]) -> None:
    lines = _emit(capsys, "text")
    fields = dict(part.split("=", 1) for part in shlex.split(lines[0]))
    assert fields["level"] == "info" and fields["logger"] == "servefleet.test"
    assert fields["msg"] == "ready: url=http://127.0.0.1:8000" and fields["replica"] == "tiny-0"
    assert fields["time"].endswith("Z")
    assert not any("hidden" in line for line in lines)
    assert lines[1].startswith("time=") and "msg=failed" in lines[1]
    assert lines[2] == "Traceback (most recent call last):"  # unexpected errors keep theirs


def test_json_is_one_object_per_line(capsys: pytest.CaptureFixture[str]) -> None:
    lines = _emit(capsys, "json")
    assert len(lines) == 2  # the traceback is a field, not extra lines
    first, second = (json.loads(line) for line in lines)
    assert first["msg"] == "ready: url=http://127.0.0.1:8000" and first["replica"] == "tiny-0"
    assert first["level"] == "info" and first["logger"] == "servefleet.test"
    assert second["level"] == "error" and "ValueError: bad" in second["exc"]


def test_uvicorn_logs_through_the_same_handler(capsys: pytest.CaptureFixture[str]) -> None:
    logging.getLogger("uvicorn.error").addHandler(logging.StreamHandler())  # as uvicorn does
    setup_logging("info", "json")
    logging.getLogger("uvicorn.error").warning("bind failed")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["logger"] == "uvicorn.error"


def test_kopf_records_name_their_object_not_kopf_internals(
    capsys: pytest.CaptureFixture[str],
) -> None:
    setup_logging("info", "text")
    ref = {"apiVersion": "apps/v1", "kind": "Deployment", "name": "m-engine", "namespace": "ns"}
    extra = {"settings": object(), "k8s_skip": True, "k8s_ref": ref}
    logging.getLogger("kopf.objects").info("Handler 'engine_changed' succeeded.")
    logging.getLogger("kopf.activities").error("Handler 'reconcile' failed.", extra=extra)
    (line,) = capsys.readouterr().err.splitlines()  # successes are quiet, failures are not
    fields = dict(part.split("=", 1) for part in shlex.split(line))
    assert fields["object"] == "Deployment ns/m-engine"
    assert "settings" not in fields and "k8s_skip" not in fields and "k8s_ref" not in fields
