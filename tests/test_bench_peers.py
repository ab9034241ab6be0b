"""The peers benchmark: each peer's command line, the skip rule, RSS sampling, and one whole
run against a stand-in `llama-server` (no real peer needed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from servefleet.bench import peers
from servefleet.bench.client import Endpoint
from servefleet.bench.peer_commands import (
    LLAMA_CPP,
    SERVEFLEET,
    VLLM_CPU,
    Installed,
    PeerCommand,
    PeerSettings,
    PeerSkipped,
    resolve_peers,
)
from servefleet.bench.rss import tree_pids, tree_pss_bytes, tree_rss_bytes

SETTINGS = PeerSettings(gguf="/models/smol.gguf")


def installed(programs: dict[str, str], modules: set[str]) -> Installed:
    return Installed(which=programs.get, has_module=modules.__contains__, python="/py")


def by_name(found: Installed) -> dict[str, PeerCommand | PeerSkipped]:
    return {p.name: p for p in resolve_peers(SETTINGS, found=found)}


def test_nothing_installed_skips_both_peers_and_says_why() -> None:
    result = by_name(installed({}, set()))
    ours = result[SERVEFLEET]
    assert isinstance(ours, PeerCommand)
    argv = ours.argv_for(8123)
    assert argv[argv.index("--model") + 1] == "/models/smol.gguf"
    assert argv[argv.index("--port") + 1] == "8123"
    assert argv[argv.index("--max-num-seqs") + 1] == "16"
    assert argv[argv.index("--threads") + 1] == "2"
    for name in (LLAMA_CPP, VLLM_CPU):
        skipped = result[name]
        assert isinstance(skipped, PeerSkipped)
        assert skipped.reason.startswith("not installed")


def test_llama_server_gets_two_threads_sixteen_slots_continuous_batching() -> None:
    peer = by_name(installed({"llama-server": "/bin/llama-server"}, {"llama_cpp"}))[LLAMA_CPP]
    assert isinstance(peer, PeerCommand)  # the binary wins over llama-cpp-python
    argv = peer.argv_for(9000)
    assert argv[:3] == ["/bin/llama-server", "-m", "/models/smol.gguf"]
    assert argv[argv.index("-t") + 1] == "2"
    assert argv[argv.index("--parallel") + 1] == "16"
    assert "-cb" in argv
    assert argv[argv.index("-c") + 1] == str(16 * 2048)  # 2048 tokens per slot
    assert argv[argv.index("--port") + 1] == "9000"
    assert (peer.ready_path, peer.endpoint) == ("/health", Endpoint.COMPLETIONS)


def test_llama_cpp_python_is_the_fallback_on_the_chat_endpoint() -> None:
    peer = by_name(installed({}, {"llama_cpp"}))[LLAMA_CPP]
    assert isinstance(peer, PeerCommand)
    argv = peer.argv_for(9001)
    assert argv[:3] == ["/py", "-m", "llama_cpp.server"]
    assert argv[argv.index("--n_threads") + 1] == "2"
    assert peer.endpoint is Endpoint.CHAT and peer.note


def test_vllm_cpu_runs_float32_bound_to_both_cores() -> None:
    peer = by_name(installed({"vllm": "/bin/vllm"}, {"vllm"}))[VLLM_CPU]
    assert isinstance(peer, PeerCommand)
    argv = peer.argv_for(9002)
    assert argv[:3] == ["/bin/vllm", "serve", "/models/smol.gguf"]
    assert argv[argv.index("--dtype") + 1] == "float32"
    assert argv[argv.index("--max-num-seqs") + 1] == "16"
    assert peer.env == {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "1"}


def test_each_engine_runs_in_the_dtype_asked() -> None:
    bf16 = PeerSettings(gguf="/m.gguf", vllm_dtype="bfloat16", matmul_dtype="bfloat16")
    found = installed({"vllm": "/bin/vllm"}, set())
    ours, _, vllm = resolve_peers(bf16, found=found)
    assert isinstance(ours, PeerCommand) and isinstance(vllm, PeerCommand)
    ours_argv, vllm_argv = ours.argv_for(1), vllm.argv_for(2)
    assert ours_argv[ours_argv.index("--matmul-dtype") + 1] == "bfloat16"
    assert vllm_argv[vllm_argv.index("--dtype") + 1] == "bfloat16"
    assert "bfloat16" in ours.note and "bfloat16" in vllm.note


def test_auto_dtype_is_bfloat16_only_where_the_cpu_has_it() -> None:
    assert peers.fastest_dtype("auto", {"avx2", "avx512f", "avx512_bf16"}) == "bfloat16"
    assert peers.fastest_dtype("auto", {"avx2", "amx_bf16"}) == "bfloat16"
    assert peers.fastest_dtype("auto", {"avx2", "fma"}) == "float32"
    assert peers.fastest_dtype("float32", {"avx512_bf16"}) == "float32"


def test_vllm_is_found_by_its_command_alone() -> None:
    """Its own environment: the module is not importable from the benchmark's interpreter."""
    assert isinstance(by_name(installed({"vllm": "/bin/vllm"}, set()))[VLLM_CPU], PeerCommand)
    assert isinstance(by_name(installed({}, {"vllm"}))[VLLM_CPU], PeerSkipped)


def test_unknown_peer_is_refused() -> None:
    with pytest.raises(ValueError, match="sglang"):
        resolve_peers(SETTINGS, ("servefleet", "sglang"))


def test_rss_covers_the_process_tree() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in tree_pids(os.getpid())
        assert tree_rss_bytes(os.getpid()) > tree_rss_bytes(child.pid) > 0
    finally:
        child.kill()
        child.wait()


SHARED_PAGES = """
import os, time
held = bytearray(os.urandom(1 << 20) * 96)  # 96 MiB, every page touched
if os.fork() == 0:  # the child shares them copy-on-write
    time.sleep(60)
print("forked", flush=True)
time.sleep(60)
"""


def test_pss_counts_pages_a_forked_child_shares_once() -> None:
    """RSS counts the 96 MiB in parent and child; PSS splits them between the two."""
    tree = subprocess.Popen([sys.executable, "-c", SHARED_PAGES], stdout=subprocess.PIPE)
    try:
        assert tree.stdout is not None and tree.stdout.readline().strip() == b"forked"
        held = 96 << 20
        assert tree_rss_bytes(tree.pid) > 2 * held
        assert held < tree_pss_bytes(tree.pid) < 1.5 * held
    finally:
        for pid in reversed(tree_pids(tree.pid)):
            os.kill(pid, 9)
        tree.wait()


STAND_IN_LLAMA_SERVER = r"""
import argparse, json, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

p = argparse.ArgumentParser()
p.add_argument("--host"); p.add_argument("--port", type=int)
args, _ = p.parse_known_args()
ballast = bytearray(64 << 20)  # 64 MB resident: the sampled RSS must see it
for i in range(0, len(ballast), 4096):
    ballast[i] = 1

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        time.sleep(0.005)
        for _ in range(body["max_tokens"]):
            chunk = {"choices": [{"index": 0, "text": " x", "finish_reason": None}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}
        self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")

ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()
"""


def test_a_run_measures_installed_peers_and_records_skipped_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server = tmp_path / "llama-server"
    server.write_text(f"#!{sys.executable}\n{STAND_IN_LLAMA_SERVER}")
    server.chmod(0o755)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    out = tmp_path / "peers.json"
    argv = ["--model", str(gguf), "--peers", "llama.cpp,vllm-cpu", "--c1-prompts", "2",
            "--c16-prompts", "4", "--parallel", "2", "--input-tokens", "8",
            "--output-tokens", "4", "--prefix-prompts", "2", "--shared-prefix-tokens", "20",
            "--out", str(out)]  # fmt: skip
    found = installed({"llama-server": str(server)}, set())
    assert peers.main(argv, found) == 0

    saved = json.loads(out.read_text())
    llama, vllm = saved["peers"]
    assert (llama["name"], llama["status"]) == (LLAMA_CPP, "measured")
    assert (vllm["name"], vllm["status"]) == (VLLM_CPU, "skipped")
    assert vllm["reason"].startswith("not installed")
    assert llama["command"][llama["command"].index("--parallel") + 1] == "2"
    runs = llama["runs"]
    assert runs["random_c16"]["parameters"]["concurrency"] == 2
    assert runs["random_c16"]["completed"] == 4 and runs["random_c1"]["completed"] == 2
    assert runs["shared_prefix_c1"]["total_input_tokens"] == 2 * (20 + 32)
    assert llama["output_tps_c16"] == runs["random_c16"]["output_token_throughput_tps"]
    assert llama["peak_rss_mb"] >= 64
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    printed = json.loads(capsys.readouterr().out)
    assert [p["status"] for p in printed] == ["measured", "skipped"]
