"""The engine benchmark scripts' plumbing, with a stand-in engine process.

The stand-in speaks the engine's CLI and HTTP surface (`--model/--host/--port`, `/ready`,
streaming `/v1/completions`), so these tests cover process start/stop, readiness, the
flags each run gets, and the JSON and PNG outputs, without loading a model.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from servefleet.bench.engine_process import EngineProcess, EngineStartError

BENCH_DIR = Path(__file__).resolve().parents[1] / "bench"

# A stdlib-only OpenAI-ish streaming server. TTFT is 5 ms with prefix caching, 40 ms with
# `--no-prefix-caching`, so the scripts' ratios have a known direction.
STAND_IN_ENGINE = r"""
import argparse, json, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

p = argparse.ArgumentParser()
p.add_argument("--model"); p.add_argument("--host"); p.add_argument("--port", type=int)
p.add_argument("--no-prefix-caching", action="store_true")
p.add_argument("--fail-start", action="store_true")
args, _ = p.parse_known_args()
if args.fail_start:
    print("stand-in: refusing to start", flush=True)
    sys.exit(3)
print("stand-in argv:", sys.argv[1:], flush=True)
ttft = 0.04 if args.no_prefix_caching else 0.005

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_GET(self):
        self.send_response(200 if self.path == "/ready" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        time.sleep(ttft)
        n = body["max_tokens"]
        for i in range(n):
            chunk = {"choices": [{"index": 0, "text": " x", "finish_reason": None}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
            time.sleep(0.001)
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}
        self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")
        self.close_connection = True

ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()
"""


@pytest.fixture
def stand_in(tmp_path: Path) -> str:
    script = tmp_path / "stand_in_engine.py"
    script.write_text(STAND_IN_ENGINE)
    return f"{sys.executable} {script}"


def _load_script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH_DIR / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_engine_process_waits_ready_and_stops(stand_in: str, tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    with EngineProcess("m", log, ["--extra"], command=stand_in.split()) as engine:
        assert engine.base_url.startswith("http://127.0.0.1:")
        proc = engine._proc
        assert proc is not None and proc.poll() is None
    assert proc.poll() is not None  # stopped on exit
    assert "'--model', 'm'" in log.read_text() and "'--extra'" in log.read_text()


def test_engine_process_reports_an_early_exit(stand_in: str, tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    with (
        pytest.raises(EngineStartError, match="exited with status 3") as info,
        EngineProcess("m", log, ["--fail-start"], command=stand_in.split()),
    ):
        pass
    assert "refusing to start" in str(info.value)


def test_prefix_caching_script(
    stand_in: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = _load_script("prefix_caching")
    out = tmp_path / "pc.json"
    argv = ["--engine-command", stand_in, "--num-prompts", "8", "--concurrency", "4",
            "--shared-prefix-tokens", "50", "--input-tokens", "8", "--output-tokens", "4",
            "--warmup", "1", "--out", str(out)]  # fmt: skip
    assert script.main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    saved = json.loads(out.read_text())
    on = saved["runs"]["with_prefix_caching"]
    off = saved["runs"]["without_prefix_caching"]
    assert on["completed"] == off["completed"] == 8
    assert on["total_input_tokens"] == 8 * 58
    assert printed["ttft_p50_ratio_with_over_without"] == pytest.approx(
        on["ttft_ms"]["p50"] / off["ttft_ms"]["p50"]
    )
    # The stand-in answers 8x slower without the cache: the flag reached the right run.
    assert printed["ttft_p50_ratio_with_over_without"] < 1
    assert "--no-prefix-caching" in (tmp_path / "pc.without_prefix_caching.engine.log").read_text()
    assert "--no-prefix-caching" not in (tmp_path / "pc.with_prefix_caching.engine.log").read_text()
    for png in (out.with_suffix(".png"), tmp_path / "pc.with_prefix_caching.png"):
        assert png.read_bytes()[:4] == b"\x89PNG"


def test_engine_vs_hf_script_engine_side(
    stand_in: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = _load_script("engine_vs_hf")
    out = tmp_path / "evh.json"
    argv = ["--engine-command", stand_in, "--skip-hf", "--num-prompts", "6", "--concurrency", "3",
            "--input-tokens", "12", "--output-tokens", "5", "--out", str(out)]  # fmt: skip
    assert script.main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text())
    assert printed["engine_output_tokens"] == printed["expected_output_tokens"] == 30
    assert printed["hf_output_tok_s"] is None and printed["ratio_engine_over_hf"] is None
    assert printed["engine"]["total_input_tokens"] == 6 * 12
    assert "'--max-num-seqs', '3'" in (tmp_path / "evh.engine.log").read_text()
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
