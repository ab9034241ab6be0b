"""Tensor parallelism as real processes: SmolLM2 (packed Q4 weights) split over three ranks
gives one process's greedy tokens; `servefleet engine` ranks serve over HTTP from rank 0,
and a rank killed mid-life takes rank 0 down with a non-zero exit and one clear log line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from servefleet.bench.processes import free_port
from tests.test_engine_process import wait_ready
from tests.test_tensor_parallel import _settings, _tiny_model, reference, run_split

SMOLLM2 = "smollm2-135m-instruct"
HANG_GUARD_S = 90  # a lost group that is not noticed would hang: this only bounds the wait


def test_smollm2_tp3_greedy_equals_tp1() -> None:
    """SmolLM2 has 9 heads and 3 KV heads: 3 ranks (2 does not divide them, refused)."""
    prompts = [[1, 504, 3458, 28, 253, 1789], [1, 9690, 314, 260, 3575, 282, 4649, 47]]
    settings = _settings(SMOLLM2, 3, kv_cache_memory="16MiB")
    (split,) = run_split([settings], prompts, 3, tokens=6)
    assert split["rank1"] == 0 and split["rank2"] == 0
    assert split["outputs"] == reference(settings, prompts, tokens=6)


def _rank(rank: int, model: str, port: int, master: int, log: Path) -> subprocess.Popen[bytes]:
    place = {"RANK": rank, "WORLD_SIZE": 2, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": master}
    env = os.environ | {name: str(value) for name, value in place.items()}
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "servefleet.cli.main", "engine", "--model", model,
             "--port", str(port), "--tensor-parallel-size", "2", "--dist-timeout", "30",
             "--kv-cache-memory", "4MiB", "--threads", "1"],
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip


def test_killed_rank_takes_the_replica_down(tmp_path: Path) -> None:
    model = str(_tiny_model(tmp_path / "tiny"))
    port, master = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    logs = [tmp_path / "rank0.log", tmp_path / "rank1.log"]
    procs = [_rank(r, model, port, master, logs[r]) for r in (0, 1)]
    try:
        wait_ready(url, procs[0], log=logs[0])
        body = {"model": model, "prompt": "t5 t6 t7", "max_tokens": 4, "temperature": 0}
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 4
        embed = httpx.post(f"{url}/v1/embeddings", json={"model": model, "input": "t5"}, timeout=30)
        assert embed.status_code == 400 and "tensor-parallel" in embed.text
        procs[1].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        code = procs[0].wait(HANG_GUARD_S)
        print(f"rank 0 exited {code} {time.monotonic() - killed:.1f} s after rank 1 was killed")
        assert code not in (0, None)
        text = logs[0].read_text()
        lost = [line for line in text.splitlines() if "group_lost" in line]
        assert len(lost) == 1 and "rank 0" in lost[0], text[-2000:]
        assert "Traceback" not in text, text[-2000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
