"""Stand-ins for local-mode tests: a tiny engine and `servefleet up`'s own serve loop.

The stand-in engine is a stdlib HTTP server with the engine's contract: `/ready` (after
`ready_after` seconds), vLLM-named `/metrics`, `/v1/chat/completions`, and the SIGTERM
drain (stop admitting, finish in-flight, exit 0). Run as `python fake_engine.py PORT
READY_AFTER`.
"""

UP_RUNNER = """
# `servefleet up`'s own serve loop, with the stand-in engine instead of the real one.
import asyncio, sys
from pathlib import Path
from servefleet.api.manifests import load_llmdeployments
from servefleet.cli.up_cmd import serve_until_signal
from servefleet.local.plane import LocalControlPlane, LocalOptions
from servefleet.local.tenants import resolve_local_tenants
manifest, port, engine = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
ready_after = sys.argv[4] if len(sys.argv) > 4 else "0.2"
tenants = resolve_local_tenants(load_llmdeployments(manifest), manifest)
options = LocalOptions(log_dir=manifest.parent / "logs", port=port,
    engine_command=lambda spec, host, p: [sys.executable, engine, str(p), ready_after])
sys.exit(asyncio.run(serve_until_signal(LocalControlPlane(tenants.deployments, tenants, options))))
"""

FAKE_ENGINE = r"""
import json, signal, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
port, ready_after = int(sys.argv[1]), float(sys.argv[2])
start, lock = time.monotonic(), threading.Lock()
state = {"running": 0, "draining": False}
class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a): pass
    def _send(self, code, body, ctype="application/json"):
        data = body.encode()
        self.send_response(code); self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data))); self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        if self.path == "/ready":
            ok = time.monotonic() - start >= ready_after and not state["draining"]
            self._send(200 if ok else 503, "{}")
        elif self.path == "/health":
            self._send(200, "{}")
        elif self.path == "/metrics":
            self._send(200, "vllm:num_requests_waiting{model_name=\"m\"} 0\n"
                       f"vllm:num_requests_running{{model_name=\"m\"}} {state['running']}\n"
                       "vllm:kv_cache_usage_perc{model_name=\"m\"} 0.25\n", "text/plain")
        else:
            self._send(404, "{}")
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if state["draining"]:
            return self._send(503, '{"error": {"message": "draining"}}')
        with lock: state["running"] += 1
        try:
            delay = json.loads(body or b"{}").get("max_tokens", 1) * 0.05
            time.sleep(delay)
            self._send(200, json.dumps({"object": "chat.completion", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "hi"},
                 "finish_reason": "stop"}], "usage": {"prompt_tokens": 1,
                 "completion_tokens": 1, "total_tokens": 2}}))
        finally:
            with lock: state["running"] -= 1
server = ThreadingHTTPServer(("127.0.0.1", port), H)
def drain(*_):
    state["draining"] = True
    def finish():
        while state["running"]: time.sleep(0.02)
        server.shutdown()
    threading.Thread(target=finish, daemon=True).start()
signal.signal(signal.SIGTERM, drain)
server.serve_forever()
sys.exit(0)
"""

MANIFEST = """
apiVersion: servefleet.io/v1alpha1
kind: LLMDeployment
metadata: {name: tiny}
spec:
  model: {name: tiny-model, source: {builtin: smollm2-135m-instruct}}
  pool: {minReplicas: 1, maxReplicas: 3, scaleDownDelay: 1, perReplicaConcurrency: 2}
  autoscaling: {targetPerReplica: 2, interval: 0.2}
"""

# An engine that cannot start: a few lines on stderr, then exit 3 (as `servefleet engine`
# does for a model it cannot load).
FAILING_ENGINE = r"""
import sys
print("loading model no-such-model", file=sys.stderr)
print("boom: cannot load no-such-model", file=sys.stderr)
sys.exit(3)
"""
