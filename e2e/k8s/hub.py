"""A Hugging Face Hub-compatible file server for PEFT folders, on an address pods reach.

What an `LLMAdapter` with `source.huggingface.endpoint` points at in the real-pod tests (there
is no hub here): the operator pod reads `adapter_config.json` from
`/<repo>/resolve/<revision>/<file>`, and an engine pod asked to load the adapter downloads
the folder with `huggingface_hub` (`/api/models/<repo>/revision/<revision>`,
`/api/models/<repo>/tree/<revision>`, then each file, HEAD and GET). The same file API as the
unit tests' loopback server (`tests/support/model_servers.py`), serving folders from disk,
bound to the node's bridge address, and remembering which client address asked for what, so
a test can tell the operator's and the engines' requests apart.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

COMMIT = "5e2e5e2e5e2e5e2e5e2e5e2e5e2e5e2e5e2e5e2e"
"""The one revision every repository has (besides `main`)."""


@dataclass
class HubServer:
    """Repositories by id (each a folder of files), and every request as (client, method,
    path)."""

    repos: dict[str, Path]
    url: str = ""
    requests: list[tuple[str, str, str]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def files(self, repo: str) -> dict[str, bytes]:
        folder = self.repos[repo]
        return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}

    def record(self, client: str, method: str, path: str) -> None:
        with self._lock:
            self.requests.append((client, method, path))

    def fetchers(self, repo: str, file: str) -> set[str]:
        """The client addresses that downloaded `file` of `repo` (at any revision)."""
        pattern = re.compile(rf"/{re.escape(repo)}/resolve/[^/]+/{re.escape(file)}")
        with self._lock:
            return {c for c, m, p in self.requests if m == "GET" and pattern.fullmatch(p)}


def _handler(state: HubServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *_: object) -> None:
            pass

        def do_HEAD(self) -> None:
            self._serve()

        def do_GET(self) -> None:
            self._serve()

        def _serve(self) -> None:
            path = unquote(urlsplit(self.path).path)
            state.record(self.client_address[0], self.command, path)
            if match := re.fullmatch(r"/api/models/(.+?)/revision/(.+)", path):
                if (files := self._repo(match[1], match[2])) is not None:
                    siblings = [{"rfilename": name} for name in files]
                    self._json({"id": match[1], "sha": COMMIT, "siblings": siblings})
            elif match := re.fullmatch(r"/api/models/(.+?)/tree/([^/]+)(/.*)?", path):
                if (files := self._repo(match[1], match[2])) is not None:
                    self._json(
                        [
                            {"type": "file", "path": n, "size": len(c), "oid": _sha1(c)}
                            for n, c in files.items()
                        ]
                    )
            elif match := re.fullmatch(r"/(.+?)/resolve/([^/]+)/(.+)", path):
                if (files := self._repo(match[1], match[2])) is not None:
                    if (content := files.get(match[3])) is None:
                        self._error(404, "entry not found", "EntryNotFound")
                    else:
                        self._file(content)
            else:
                self._error(404, "not found", "")

        def _repo(self, repo: str, revision: str) -> dict[str, bytes] | None:
            """The repository's files, or None after answering what the Hub answers."""
            if repo not in state.repos:
                self._error(404, "repository not found", "RepoNotFound")
                return None
            if unquote(revision) not in (COMMIT, "main"):
                self._error(404, "revision not found", "RevisionNotFound")
                return None
            return state.files(repo)

        def _error(self, status: int, message: str, code: str) -> None:
            body = json.dumps({"error": message}).encode()
            self.send_response(status)
            if code:
                self.send_header("X-Error-Code", code)
                self.send_header("X-Error-Message", message)
            self._body(body, "application/json", {})

        def _json(self, value: object) -> None:
            self.send_response(200)
            self._body(json.dumps(value).encode(), "application/json", {})

        def _file(self, content: bytes) -> None:
            self.send_response(200)
            headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{_sha1(content)}"'}
            self._body(content, "application/octet-stream", headers)

        def _body(self, body: bytes, content_type: str, headers: dict[str, str]) -> None:
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

    return Handler


def _sha1(content: bytes) -> str:
    return hashlib.sha1(content).hexdigest()


@contextmanager
def serve_hub(state: HubServer, address: str) -> Iterator[HubServer]:
    """Serve `state` on a free port of `address` until the block ends."""
    server = ThreadingHTTPServer((address, 0), _handler(state))
    server.daemon_threads = True
    state.url = f"http://{address}:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
