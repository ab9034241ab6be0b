"""Schemathesis against a real engine (SmolLM2) and a gateway in front of it, from their own
`/openapi.json`.

Each server's document is fetched, generation is bounded for the run (the model fixed, a few
completion tokens, n <= 2) so thousands of cases fit in minutes, and schemathesis sends valid
and invalid requests to every operation. Every answer must be a non-5xx, and every 4xx the
OpenAI error body the document declares (`response_schema_conformance` checks the `4XX` schema).
A short second pass sends only schema-valid cases to the two generating operations, so valid
requests are shown to reach the model whatever share of the first pass's time they got.
Strings are generated as UTF-8, so what only escapes can send (a lone `\\ud800`) is pinned
in `tests/test_fuzz_regressions.py` instead.
Run it on its own:
    uv run pytest e2e/test_fuzz.py -s
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from procs import free_port, servefleet_command

from servefleet.api.batches import BatchConfig
from servefleet.api.gateway_config import (
    ApiKeyRef,
    GatewayConfig,
    GatewayDeployment,
    GatewayTenant,
    SecretValueRef,
    TenantAccess,
    hash_api_key,
)
from servefleet.api.kv_events import EVENTS_PATH

MODEL = "smollm2-135m-instruct"
ENGINE_KEY = "engine-fuzz-key"
TENANT_KEY = "tenant-fuzz-key"
READY_TIMEOUT_S = float(os.environ.get("SERVEFLEET_E2E_READY_S", "240"))
# Per server. Its coverage phase alone took 44 s of 45 once under a full CI machine, leaving
# the fuzzing phase none (235 cases, fewer than the 300 asked for).
FUZZ_SECONDS = int(os.environ.get("SERVEFLEET_E2E_FUZZ_S", "75"))
VALID_SECONDS = 15  # the valid-only pass on the two generating operations
GENERATING = "^/v1/(chat/)?completions$"
MAX_FUZZ_TOKENS = 4
ENGINE_ARGS = ["--max-num-seqs", "4", "--threads", "1", "--kv-cache-memory", "64MiB"]
ENGINE_ARGS += ["--max-model-len", "256", "--api-key", ENGINE_KEY]
CHECKS = "not_a_server_error,response_schema_conformance"


@dataclass
class Server:
    name: str
    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def _start(name: str, argv: list[str], url: str, logs: Path) -> Server:
    log = logs / f"{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
    server = Server(name, proc, url, log)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{name} exited with {proc.returncode}:\n{server.tail()}")
        try:
            if httpx.get(url + "/ready", timeout=5).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    pytest.fail(f"{name} not ready after {READY_TIMEOUT_S:g}s:\n{server.tail()}")


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    logs = tmp_path_factory.mktemp("fuzz")
    started: list[Server] = []
    try:
        port = free_port()
        argv = [*servefleet_command(), "engine", "--model", MODEL, "--host", "127.0.0.1"]
        engine_url = f"http://127.0.0.1:{port}"
        started.append(
            _start("engine", [*argv, "--port", str(port), *ENGINE_ARGS], engine_url, logs)
        )
        key_file = logs / "engine-key"
        key_file.write_text(ENGINE_KEY)
        config = GatewayConfig(
            host="127.0.0.1",
            batch=BatchConfig(store_dir=str(logs / "batches")),  # /v1/files, /v1/batches too
            tenants=[
                GatewayTenant(name="fuzz", api_keys=[ApiKeyRef(sha256=hash_api_key(TENANT_KEY))])
            ],
            deployments=[
                GatewayDeployment(
                    name="smollm2",
                    model=MODEL,
                    endpoints=[engine_url],
                    tenants=[TenantAccess(name="fuzz")],
                    engine_api_key=SecretValueRef(file=str(key_file)),  # a value dumps masked
                    upstream_timeout_seconds=120,
                )
            ],
        )
        config_file = logs / "gateway.yaml"
        config_file.write_text(config.model_dump_json(by_alias=True, exclude_none=True))
        port, internal = free_port(), free_port()
        argv = [*servefleet_command(), "gateway", "--config", str(config_file), "--port", str(port)]
        internal_key = logs / "internal-key"
        internal_key.write_text("sk-internal-fuzz")
        argv += ["--internal-port", str(internal), "--internal-api-key-file", str(internal_key)]
        started.append(_start("gateway", argv, f"http://127.0.0.1:{port}", logs))
        yield {s.name: s for s in started}
    finally:
        for server in started:
            if server.proc.poll() is None:
                server.proc.kill()
            server.proc.wait(timeout=30)


def bounded_for_fuzzing(document: dict[str, Any]) -> dict[str, Any]:
    """The served document with generation kept short: the served model, at most
    `MAX_FUZZ_TOKENS` completion tokens (always set), n <= 2. Invalid data still violates it.
    The KV event stream is left out: it never ends (a follower holds it open), so every case
    would wait for the request timeout; `tests/test_kv_events_engine.py` covers it."""
    document["paths"].pop(EVENTS_PATH, None)
    schemas = document["components"]["schemas"]
    # enums, not bounds: JSON Schema's integer includes 1.0, which the servers refuse (strict)
    tokens = {"enum": list(range(1, MAX_FUZZ_TOKENS + 1))}
    for name in ("ChatCompletionRequest", "CompletionRequest", "EmbeddingRequest"):
        schema = schemas[name]
        schema["properties"]["model"] = {"type": "string", "enum": [MODEL]}
        if name == "EmbeddingRequest":
            continue
        schema["properties"]["max_tokens"] = tokens
        schema["properties"]["n"] = {"enum": [1, 2]}
        schema["required"] = sorted({*schema.get("required", ()), "max_tokens"})
        if "max_completion_tokens" in schema["properties"]:
            schema["properties"]["max_completion_tokens"] = tokens
    return document


def _fuzz(server: Server, key: str, work: Path, *only: str) -> dict[str, Any]:
    """Run schemathesis against `server` (with `only` its arguments that narrow the run); its
    JSON report (cases, failures)."""
    # The engine's document is behind its key like every path but the probes.
    headers = {"authorization": f"Bearer {key}"}
    document = httpx.get(server.url + "/openapi.json", headers=headers, timeout=10).json()
    schema_file = work / f"{server.name}-openapi.json"
    schema_file.write_text(json.dumps(bounded_for_fuzzing(document)))
    report = work / f"{server.name}{len(only)}-report.json"
    argv = [str(Path(sys.executable).parent / "st"), "run", str(schema_file), "--url", server.url]
    # One worker: with several, hypothesis's strategy reprs race in ast.parse (a SystemError).
    argv += ["--checks", CHECKS, "-H", f"Authorization: Bearer {key}", "--workers", "1"]
    argv += ["--max-examples", "300", "--request-timeout", "120"]
    argv += ["--seed", "1", "--no-shrink", "--suppress-health-check", "all"]
    argv += ["--report", "json", "--report-json-path", str(report), "--no-color"]
    argv += ["--generation-database", "none"]
    # no links between operations: nothing stateful
    argv += only or [
        "--max-time",
        str(FUZZ_SECONDS),
        "--mode",
        "all",
        "--phases",
        "coverage,fuzzing",
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=FUZZ_SECONDS * 3, cwd=work)
    print(done.stdout[-6000:])
    assert report.exists(), f"schemathesis wrote no report:\n{done.stdout}\n{done.stderr}"
    assert done.returncode == 0, f"schemathesis found failures:\n{done.stdout[-20000:]}"
    return dict(json.loads(report.read_text()))


def _accepted(report: dict[str, Any], operation: str) -> int:
    rates = report["valid_rates"].get(operation, {})
    return sum(phase["accepted"] for phase in rates.values())


@pytest.mark.parametrize(("name", "key"), [("engine", ENGINE_KEY), ("gateway", TENANT_KEY)])
def test_fuzz_finds_no_server_error(
    servers: dict[str, Server], name: str, key: str, tmp_path: Path
) -> None:
    server = servers[name]
    probe = {"model": MODEL, "prompt": "Hello", "max_tokens": 1}
    headers = {"authorization": f"Bearer {key}"}
    answer = httpx.post(server.url + "/v1/completions", json=probe, headers=headers, timeout=60)
    assert answer.status_code == 200, answer.text  # the fuzz reaches the model, not a refusal
    report = _fuzz(server, key, tmp_path)
    cases = report["test_cases"]
    print(f"{name}: {cases['generated']} cases, {cases['with_failures']} with failures")
    assert report["failures"] == [] and report["errors"] == [] and cases["with_failures"] == 0
    assert cases["generated"] >= 300
    # Valid requests reach the model too, whatever share of the time above they got: a
    # short pass of schema-valid cases on the two operations that generate.
    valid = ["--include-path-regex", GENERATING, "--mode", "positive", "--phases", "fuzzing"]
    report = _fuzz(server, key, tmp_path, *valid, "--max-time", str(VALID_SECONDS))
    assert report["failures"] == [] and report["errors"] == []
    for operation in ("POST /v1/chat/completions", "POST /v1/completions"):
        assert _accepted(report, operation) > 0, f"no valid {operation} reached {name}"
    for child in servers.values():
        assert child.proc.poll() is None, f"{child.name} died:\n{child.tail()}"
