"""Gateway overhead: added latency per request and proxied streaming requests/s.

Starts an instant OpenAI-compatible upstream and a `servefleet gateway` process (pinned to one
core when the machine has two or more), then measures
  1. added latency: the same non-streaming request sent one at a time, alternately straight to
     the upstream and through the gateway; p50/p99 of each and their difference;
  2. streaming throughput: many keep-alive connections sending streaming requests through the
     gateway for a fixed time; completed requests/s and requests per gateway CPU-second (what
     one fully used core sustains).
Prints one JSON summary and writes JSON + PNG (default: bench/results/).

    uv run python bench/gateway_overhead.py [--latency-requests 2000] [--seconds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from servefleet.api.gateway_config import hash_api_key
from servefleet.bench.processes import free_port

KEY = "bench-key"
INTERNAL_KEY = "bench-internal-key"  # the internal port (stats) answers only this key


def _pin(core: int | None) -> Any:
    if core is None:
        return None
    return lambda: os.sched_setaffinity(0, {core})


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def _wait_http(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not become ready")


class RawClient:
    """A minimal keep-alive HTTP/1.1 client: cheap enough not to be the bottleneck."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes, *, on_first_byte: Any = None) -> int:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        assert self.reader is not None
        self.writer.write(
            f"POST {path} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        lower = head.lower()
        if b"content-length:" in lower:
            length = int(lower.split(b"content-length:")[1].split(b"\r\n")[0])
            await self.reader.readexactly(length)
        else:  # chunked
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).strip(), 16)
                if on_first_byte is not None:
                    on_first_byte()
                    on_first_byte = None
                await self.reader.readexactly(size + 2)
                if size == 0:
                    break
        return status


def _chat(stream: bool) -> bytes:
    return json.dumps(
        {
            "model": "bench",
            "messages": [{"role": "user", "content": "Say something short."}],
            "max_tokens": 8,
            "stream": stream,
        }
    ).encode()


async def measure_latency(upstream_port: int, gateway_port: int, n: int) -> dict[str, list[float]]:
    direct, via = RawClient(upstream_port), RawClient(gateway_port)
    body = _chat(False)
    samples: dict[str, list[float]] = {"direct": [], "gateway": []}
    for _ in range(100):  # warm-up: connections, caches
        await direct.post("/v1/chat/completions", body)
        await via.post("/v1/chat/completions", body)
    for _ in range(n):
        for name, client in (("direct", direct), ("gateway", via)):
            t0 = time.perf_counter()
            status = await client.post("/v1/chat/completions", body)
            samples[name].append(time.perf_counter() - t0)
            assert status == 200, status
    return samples


async def measure_streaming(port: int, seconds: float, concurrency: int) -> dict[str, Any]:
    body = _chat(True)
    done = 0
    errors = 0
    stop = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done, errors
        client = RawClient(port)
        while time.perf_counter() < stop:
            status = await client.post("/v1/chat/completions", body)
            if status == 200:
                done += 1
            else:
                errors += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - t0
    return {"completed": done, "errors": errors, "seconds": elapsed, "rps": done / elapsed}


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--latency-requests", type=int, default=2000)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--out", default="bench/results/gateway_overhead.json")
    args = parser.parse_args()

    cores = sorted(os.sched_getaffinity(0))
    gateway_core = cores[0] if len(cores) > 1 else None
    other_core = cores[1] if len(cores) > 1 else None
    up_port, gw_port, internal_port = free_port(), free_port(), free_port()
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory() as tmp:
        key_path = Path(tmp) / "internal-key"
        key_path.write_text(INTERNAL_KEY)
        config = {
            "host": "127.0.0.1",
            "port": gw_port,
            "internal_port": internal_port,
            "internal_api_key": {"file": str(key_path)},
            "tenants": [
                {
                    "name": "bench",
                    "api_keys": [{"sha256": hash_api_key(KEY)}],
                    "limits": {
                        "requests_per_minute": 10_000_000,
                        "tokens_per_minute": 1_000_000_000,
                    },
                }
            ],
            "deployments": [
                {
                    "name": "bench",
                    "model": "bench",
                    "endpoints": [f"http://127.0.0.1:{up_port}"],
                    "pool": {"per_replica_concurrency": 1024},
                    "tenants": [{"name": "bench"}],
                }
            ],
        }
        config_path = Path(tmp) / "gateway.json"
        config_path.write_text(json.dumps(config))
        try:
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "servefleet.bench.fake_upstream",
                        "--port",
                        str(up_port),
                    ],
                    preexec_fn=_pin(other_core),
                )
            )
            gateway = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "servefleet.cli.main",
                    "gateway",
                    "--config",
                    str(config_path),
                    "--log-level",
                    "warning",
                ],
                preexec_fn=_pin(gateway_core),
            )
            procs.append(gateway)
            if other_core is not None:
                os.sched_setaffinity(0, {other_core})
            _wait_http(f"http://127.0.0.1:{up_port}/ready")
            _wait_http(f"http://127.0.0.1:{gw_port}/ready")
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                stats = httpx.get(
                    f"http://127.0.0.1:{internal_port}/internal/deployments",
                    headers={"authorization": f"Bearer {INTERNAL_KEY}"},
                ).json()
                if stats[0]["ready_replicas"] == 1:
                    break
                time.sleep(0.1)
            samples = asyncio.run(measure_latency(up_port, gw_port, args.latency_requests))
            cpu0 = _cpu_seconds(gateway.pid)
            streaming = asyncio.run(measure_streaming(gw_port, args.seconds, args.concurrency))
            gateway_cpu = _cpu_seconds(gateway.pid) - cpu0
            direct_streaming = asyncio.run(
                measure_streaming(up_port, min(args.seconds, 5.0), args.concurrency)
            )
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(timeout=10)

    d, g = samples["direct"], samples["gateway"]
    added = sorted(b - a for a, b in zip(d, g, strict=True))
    summary = {
        "benchmark": "gateway_overhead",
        "gateway_pinned_to_core": gateway_core,
        "latency_requests": args.latency_requests,
        "direct_p50_ms": pct(d, 0.5) * 1e3,
        "direct_p99_ms": pct(d, 0.99) * 1e3,
        "gateway_p50_ms": pct(g, 0.5) * 1e3,
        "gateway_p99_ms": pct(g, 0.99) * 1e3,
        "added_p50_ms": (pct(g, 0.5) - pct(d, 0.5)) * 1e3,
        "added_p99_ms": (pct(g, 0.99) - pct(d, 0.99)) * 1e3,
        "added_pairwise_median_ms": statistics.median(added) * 1e3,
        "streaming_concurrency": args.concurrency,
        "streaming_rps": streaming["rps"],
        "streaming_errors": streaming["errors"],
        "gateway_cpu_seconds": gateway_cpu,
        "streaming_rps_per_gateway_core": streaming["completed"] / max(gateway_cpu, 1e-9),
        "direct_streaming_rps": direct_streaming["rps"],
        "targets": {"added_p50_ms": 2.0, "streaming_rps_one_core": 500},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2))
    _plot(samples, summary, out.with_suffix(".png"))
    print(json.dumps(summary))
    return 0


def _plot(samples: dict[str, list[float]], summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, values in samples.items():
        ordered = sorted(v * 1e3 for v in values)
        left.plot(ordered, [i / len(ordered) for i in range(len(ordered))], label=name)
    left.set_xlabel("latency (ms)")
    left.set_ylabel("fraction of requests")
    left.set_title(f"non-streaming latency; added p50 {summary['added_p50_ms']:.2f} ms")
    left.set_xlim(0, pct(samples["gateway"], 0.995) * 1e3)
    left.legend()
    bars = {
        "gateway": summary["streaming_rps"],
        "gateway per core": summary["streaming_rps_per_gateway_core"],
        "upstream direct": summary["direct_streaming_rps"],
    }
    right.bar(list(bars), list(bars.values()))
    right.axhline(500, color="red", linestyle="--", label="target 500/s")
    right.set_ylabel("streaming requests/s")
    right.legend()
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    sys.exit(main())
