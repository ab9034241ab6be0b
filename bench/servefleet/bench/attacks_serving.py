"""Attacks on the serving path with one tenant key: requests built to stall an engine or the
gateway, to walk around limits, or to reach what only the gateway may reach.

Each function does its attack against a running `AttackStack` and records in `result` what the
attacker got and what it must not have got; `attack_suite` runs it while the victim's load and
the health probes run, and judges those.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from functools import partial

import httpx
import psutil

from servefleet.api.budgets import budget_header
from servefleet.api.kv_events import EVENTS_PATH
from servefleet.api.kv_transfer import EXPORT_PATH, IMPORT_PATH, INFO_PATH
from servefleet.api.kv_warm import HOT_PATH, WARM_PATH
from servefleet.bench import attack_payloads as payloads
from servefleet.bench.attack_common import AttackResult, timed
from servefleet.bench.attack_sockets import CutResult, slow_body
from servefleet.bench.attack_stack import (
    ATTACKER,
    BUDGETED,
    CAPPED_ATTACKER,
    ENGINE_KEY,
    AttackStack,
)
from servefleet.bench.fault_load import RequestSpec, closed_loop
from servefleet.bench.fault_stack import api_key

# A refusal must come before any expensive step: seconds, not the minutes the stall took.
REFUSAL_BOUND_S = 10.0
# A slow body is cut by the server's body deadline (plus a probe's worth of slack).
SLOW_BODY_BOUND_S = 75.0
GATEWAY_RSS_BOUND_MB = 1024.0  # the chart's memory limit for the gateway


def _error(response: httpx.Response) -> dict[str, object]:
    try:
        found = response.json().get("error")
    except ValueError:
        return {}
    return found if isinstance(found, dict) else {}


def _refused(
    result: AttackResult,
    label: str,
    call: Callable[[], httpx.Response],
    statuses: tuple[int, ...],
    param: str | None = None,
) -> httpx.Response:
    """Runs `call`; requires one of `statuses` within the refusal bound (and `param` named)."""
    response, seconds = timed(call)
    error = _error(response)
    result.figures[label] = {"status": response.status_code, "seconds": seconds, "error": error}
    result.require(
        response.status_code in statuses,
        f"{label}: status {response.status_code}, wanted one of {statuses}: {response.text[:200]}",
    )
    result.require(seconds <= REFUSAL_BOUND_S, f"{label}: refused only after {seconds} s")
    if param is not None:
        result.require(error.get("param") == param, f"{label}: error names {error.get('param')!r}")
    return response


def _outcome(result: AttackResult) -> str:
    return "; ".join(
        f"{label} {fig['status']} in {fig['seconds']} s"
        for label, fig in result.figures.items()
        if isinstance(fig, dict) and "status" in fig
    )


def tools_flood(stack: AttackStack, result: AttackResult) -> None:
    """Chat with a 0.3 MB tools list (50 functions x 200 properties), three times."""
    body = payloads.tools_flood()
    result.figures["body_kb"] = len(body) // 1024
    for attempt in range(3):
        _refused(
            result,
            f"try {attempt + 1}",
            lambda: stack.post("/v1/chat/completions", body),
            (400,),
            param="tools",
        )
    result.outcome = _outcome(result)


def tokenize_flood(stack: AttackStack, result: AttackResult) -> None:
    """/tokenize of 15 MB of text."""
    body = payloads.tokenize_flood()
    _refused(result, "tokenize", lambda: stack.post("/tokenize", body), (400, 413))
    result.outcome = _outcome(result)


def guided_choice_flood(stack: AttackStack, result: AttackResult) -> None:
    """Completion with a guided_choice of 100,000 items."""
    body = payloads.guided_choice_flood()
    _refused(
        result,
        "completion",
        lambda: stack.post("/v1/completions", body),
        (400, 413),
    )
    result.outcome = _outcome(result)


def many_sequences(stack: AttackStack, result: AttackResult) -> None:
    """One completion of 300 prompts x n=16 (4,800 sequences)."""
    body = payloads.many_sequences()
    _refused(result, "completion", lambda: stack.post("/v1/completions", body), (400, 429))
    result.outcome = _outcome(result)


def huge_message(stack: AttackStack, result: AttackResult) -> None:
    """Chat with one 15 MB message, twice.

    Refused, and the gateway's memory stays under its pod's limit meanwhile."""
    body = payloads.huge_message()
    gateway = stack.gateway
    assert gateway.proc is not None
    process = psutil.Process(gateway.proc.pid)
    before = process.memory_info().rss / 2**20
    peak = [before]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], process.memory_info().rss / 2**20)
            done.wait(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        for attempt in range(2):
            _refused(
                result,
                f"try {attempt + 1}",
                lambda: stack.post("/v1/chat/completions", body),
                (400, 413),
            )
    finally:
        done.set()
        sampler.join()
    result.figures["gateway_rss_mb"] = {"before": round(before), "peak": round(peak[0])}
    result.require(
        peak[0] <= GATEWAY_RSS_BOUND_MB,
        f"gateway RSS peaked at {peak[0]:.0f} MB (> {GATEWAY_RSS_BOUND_MB:.0f} MB)",
    )
    result.outcome = _outcome(result) + f"; gateway RSS peak {peak[0]:.0f} MB"


def slow_bodies(stack: AttackStack, result: AttackResult) -> None:
    """A head, then one body byte a second, to the gateway and an engine at once.

    Both must cut the connection by their body deadline."""
    targets = {
        "gateway": (stack.gateway.url, api_key(ATTACKER)),
        "engine": (stack.engines[0].url, ENGINE_KEY),  # what only the gateway could send
    }
    found: dict[str, CutResult] = {}

    def one(name: str) -> None:
        url, key = targets[name]
        found[name] = slow_body(url, "/v1/chat/completions", key, max_s=SLOW_BODY_BOUND_S + 15)

    threads = [threading.Thread(target=one, args=(name,)) for name in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for name, cut in found.items():
        result.figures[name] = {"status": cut.status, "seconds": cut.seconds, "cut": cut.cut}
        result.require(cut.cut, f"{name}: a slow body was never cut ({cut.seconds} s)")
        result.require(cut.status == 408, f"{name}: answered {cut.status}, not 408")
        result.require(
            cut.seconds <= SLOW_BODY_BOUND_S, f"{name}: slow body cut only after {cut.seconds} s"
        )
    result.outcome = "; ".join(
        f"{name} cut after {c.seconds} s ({c.status or 'closed'})" for name, c in found.items()
    )


def huge_priority(stack: AttackStack, result: AttackResult) -> None:
    """Chat with priority -10**30."""
    body = payloads.huge_priority()
    _refused(
        result,
        "chat",
        lambda: stack.post("/v1/chat/completions", body),
        (400,),
        param="priority",
    )
    result.outcome = _outcome(result)


def prompts_times_n(stack: AttackStack, result: AttackResult) -> None:
    """10 prompts x n=16 x 8 tokens against a 1,000 tokens-a-minute limit.

    Reserved for every prompt x n, it is more than the whole limit: refused, never served."""
    body = payloads.prompts_times_n()
    _refused(
        result,
        "completion",
        lambda: stack.post("/v1/completions", body, tenant=CAPPED_ATTACKER),
        (400, 429),  # 400: more than the whole limit, so it could never be admitted
    )
    result.outcome = _outcome(result)


def budget_self_raise(stack: AttackStack, result: AttackResult) -> None:
    """A tenant with a 400-token daily budget sends budget headers and fields to raise it.

    Budget headers a tenant sends are not read and budget-like fields are a 400 naming them,
    so once the budget is spent every request is a 429 insufficient_quota."""
    forged = {
        budget_header("daily", "tokens", "remaining"): "1000000",
        budget_header("daily", "tokens", "used-ratio"): "0",
        budget_header("daily", "tokens", "reset"): "1970-01-01T00:00:00Z",
    }
    headers = {**stack.tenant_headers(BUDGETED), **forged}
    body = json.dumps(payloads.chat("Say hi.", max_tokens=8)).encode()

    def chat(content: bytes = body) -> httpx.Response:
        url = stack.url + "/v1/chat/completions"
        return httpx.post(url, content=content, headers=headers, timeout=180.0)

    served = 0
    while (answer := chat()).status_code == 200 and served < 100:
        served += 1
    result.figures["served_before_429"] = served
    result.require(_error(answer).get("code") == "insufficient_quota", answer.text[:200])
    for field in ("budget", "daily_token_budget"):
        raise_it = json.dumps(payloads.chat("Say hi.", **{field: 10**9})).encode()
        _refused(result, field, partial(chat, raise_it), (400,), param=field)
    last = _refused(result, "after", chat, (429,))
    result.require(_error(last).get("code") == "insufficient_quota", last.text[:200])
    result.outcome = f"{served} served, then " + _outcome(result)


def logit_bias_digits(stack: AttackStack, result: AttackResult) -> None:
    """A logit_bias key of 4,400 digits."""
    body = payloads.long_logit_bias_key()
    _refused(
        result,
        "chat",
        lambda: stack.post("/v1/chat/completions", body),
        (400,),
        param="logit_bias",
    )
    result.outcome = _outcome(result)


def wrong_methods(stack: AttackStack, result: AttackResult) -> None:
    """GET on a POST path, on the gateway and on an engine.

    405 method_not_allowed from the gateway (tenant key) and from an engine (with the
    engine's own key: without it, it is a 401 before anything else)."""
    targets = {
        "gateway": (stack.gateway.url, stack.tenant_headers(ATTACKER)),
        "engine": (stack.engines[0].url, {"authorization": f"Bearer {ENGINE_KEY}"}),
    }
    for name, (url, headers) in targets.items():
        call = partial(httpx.get, url + "/v1/chat/completions", headers=headers)
        response = _refused(result, name, call, (405,))
        code = _error(response).get("code")
        result.require(code == "method_not_allowed", f"{name}: code {code!r}")
        result.require("POST" in response.headers.get("allow", ""), f"{name}: no Allow: POST")
    result.outcome = _outcome(result)


LOAD_ADAPTER = "/v1/load_lora_adapter"


def engine_bypass(stack: AttackStack, result: AttackResult) -> None:
    """A tenant calls an engine directly: chat, tokenize, detokenize, models, KV transfer and
    KV cache events, and loads a LoRA adapter from a path of its choosing, there and through
    the gateway.

    Whoever finds an engine's address gets nothing from it without the engine key (KV blocks
    neither read nor planted); the gateway's tenant port has no adapter control path at all,
    and refuses `kv_transfer_params` (a pull to an address of the tenant's choosing, or a
    prefill engine of its choosing)."""
    engine = stack.engines[0].url
    chat = payloads.chat("hi", max_tokens=2)
    calls: dict[str, tuple[str, str, dict[str, object] | None]] = {
        "chat": ("POST", "/v1/chat/completions", chat),
        "tokenize": ("POST", "/tokenize", {"model": chat["model"], "prompt": "hi"}),
        "detokenize": ("POST", "/detokenize", {"model": chat["model"], "tokens": [1, 2]}),
        "models": ("GET", "/v1/models", None),
        "load adapter": ("POST", LOAD_ADAPTER, {"lora_name": "evil", "lora_path": "/etc"}),
        "kv info": ("GET", INFO_PATH, None),
        "kv export": ("POST", EXPORT_PATH, {"hashes": ["0" * 32]}),
        "kv prefill": ("POST", EXPORT_PATH, {"prompt_token_ids": [1] * 64, "compute": True}),
        "kv import": ("POST", IMPORT_PATH, None),
        "kv hot": ("POST", HOT_PATH, {}),
        "kv warm": ("POST", WARM_PATH, {"sources": ["http://127.0.0.1:9"]}),
        "kv events": ("GET", EVENTS_PATH, None),  # which prefixes the replica caches
    }
    headers = stack.tenant_headers(ATTACKER)
    for label, (method, path, body) in calls.items():
        call = partial(httpx.request, method, engine + path, json=body, headers=headers)
        _refused(result, label, call, (401,))
    load = json.dumps(calls["load adapter"][2]).encode()
    _refused(result, "load adapter via gateway", lambda: stack.post(LOAD_ADAPTER, load), (404,))
    pull = json.dumps({**chat, "kv_transfer_params": {"kv_sources": ["http://127.0.0.1:9"]}})
    _refused(
        result,
        "kv pull via gateway",
        lambda: stack.post("/v1/chat/completions", pull.encode()),
        (400,),
        param="kv_transfer_params",
    )
    remote = {**chat, "kv_transfer_params": {"remote_prefill": "http://127.0.0.1:9"}}
    _refused(
        result,
        "remote prefill via gateway",
        lambda: stack.post("/v1/chat/completions", json.dumps(remote).encode()),
        (400,),
        param="kv_transfer_params",
    )
    result.outcome = _outcome(result)


def disconnect_storm(stack: AttackStack, result: AttackResult) -> None:
    """Streams dropped after two tokens, one after another for 6 s.

    No traceback or error in any process's log for it. (One client: more at once would be
    load the tenant is entitled to, which shares the cores with the victim; that is
    capacity, which fair queuing and limits handle, not what this attack is about.)"""
    offsets = {part.name: part.log.stat().st_size for part in stack.parts()}
    spec = RequestSpec(prompt="Tell a long story.", max_tokens=200, leave_after_tokens=2)
    load = asyncio.run(closed_loop(stack.gateway.url, ATTACKER, 1, 6.0, spec))
    time.sleep(1.0)
    noisy = {}
    for part in stack.parts():
        with part.log.open("rb") as log:
            log.seek(offsets[part.name])
            text = log.read().decode(errors="replace")
        lines = [line for line in text.splitlines() if "Traceback" in line or "Error" in line]
        if lines:
            noisy[part.name] = lines[:3]
    result.figures["streams_left"] = load.counts().get("left", 0)
    result.figures["log_errors"] = noisy
    result.require(not noisy, f"tracebacks or errors logged for client disconnects: {noisy}")
    result.outcome = f"{result.figures['streams_left']} streams dropped; logs clean: {not noisy}"
