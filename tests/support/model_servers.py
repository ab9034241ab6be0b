"""Real servers for model downloads, on loopback: plain HTTP files and a Hub-compatible
file API (what `huggingface_hub` calls when HF_ENDPOINT / `endpoint` points at it), and
an S3-compatible server (moto's server mode, in its own process). Never the internet."""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

import httpx


@dataclass
class HubRepo:
    """One repository: its commit id, files, and the token it needs (None = public)."""

    files: dict[str, bytes]
    commit: str = "0123456789abcdef0123456789abcdef01234567"
    token: str | None = None


@dataclass
class ModelFileServer:
    """State shared with the handler: what is served, and what was asked for."""

    files: dict[str, bytes] = field(default_factory=dict)  # /files/<name>
    repos: dict[str, HubRepo] = field(default_factory=dict)
    requests: list[tuple[str, str, str]] = field(default_factory=list)  # method, path, Range
    body_bytes: dict[str, int] = field(default_factory=dict)  # path -> bytes sent
    seconds_per_chunk: float = 0.0
    url: str = ""

    def record(self, method: str, path: str, range_header: str) -> None:
        self.requests.append((method, path, range_header))

    def gets(self, path_part: str) -> int:
        return sum(1 for m, p, _ in self.requests if m == "GET" and path_part in p)


def _handler(state: ModelFileServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *_: object) -> None:
            pass

        def do_HEAD(self) -> None:
            self._serve(head=True)

        def do_GET(self) -> None:
            self._serve(head=False)

        def _serve(self, head: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            state.record(self.command, self.path, self.headers.get("Range", ""))
            if path.startswith("/files/"):
                content = state.files.get(path.removeprefix("/files/"))
                if path.startswith("/files/private/"):
                    return self._status(401, "no credentials")
                if content is None:
                    return self._status(404, "no such file")
                return self._file(path, content, head, {})
            if match := re.fullmatch(r"/api/models/(.+?)/revision/(.+)", path):
                repo = self._repo(match[1], match[2])
                if repo is not None:
                    siblings = [{"rfilename": name} for name in sorted(repo.files)]
                    self._json({"id": match[1], "sha": repo.commit, "siblings": siblings})
                return None
            if match := re.fullmatch(r"/api/models/(.+?)/tree/([^/]+)(/.*)?", path):
                repo = self._repo(match[1], match[2])
                if repo is not None:
                    self._json(
                        [
                            {"type": "file", "path": n, "size": len(c), "oid": _sha1(c)}
                            for n, c in sorted(repo.files.items())
                        ]
                    )
                return None
            if match := re.fullmatch(r"/(.+?)/resolve/([^/]+)/(.+)", path):
                repo = self._repo(match[1], match[2])
                if repo is None:
                    return None
                content = repo.files.get(match[3])
                if content is None:
                    return self._status(404, "entry not found", code="EntryNotFound")
                headers = {"X-Repo-Commit": repo.commit, "ETag": f'"{_sha1(content)}"'}
                return self._file(path, content, head, headers)
            return self._status(404, "not found")

        def _repo(self, repo_id: str, revision: str) -> HubRepo | None:
            """The repository, or None after answering what the Hub answers."""
            repo = state.repos.get(repo_id)
            if repo is None:
                self._status(404, "repository not found", code="RepoNotFound")
                return None
            if repo.token and self.headers.get("Authorization") != f"Bearer {repo.token}":
                self._status(401, "invalid credentials", code="RepoNotFound")
                return None
            if unquote(revision) not in (repo.commit, "main"):
                self._status(404, "revision not found", code="RevisionNotFound")
                return None
            return repo

        def _status(self, status: int, message: str, code: str = "") -> None:
            body = json.dumps({"error": message}).encode()
            self.send_response(status)
            if code:
                self.send_header("X-Error-Code", code)
                self.send_header("X-Error-Message", message)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _json(self, value: object) -> None:
            body = json.dumps(value).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _file(self, path: str, content: bytes, head: bool, headers: dict[str, str]) -> None:
            start = 0
            if match := re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", "")):
                start = int(match[1])
                if start >= len(content):
                    return self._status(416, "range not satisfiable")
            part = content[start:]
            self.send_response(206 if start else 200)
            for key, value in headers.items():
                self.send_header(key, value)
            if start:
                self.send_header(
                    "Content-Range", f"bytes {start}-{len(content) - 1}/{len(content)}"
                )
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(len(part)))
            self.end_headers()
            if head:
                return None
            for offset in range(0, len(part), 65536):
                chunk = part[offset : offset + 65536]
                self.wfile.write(chunk)
                state.body_bytes[path] = state.body_bytes.get(path, 0) + len(chunk)
                if state.seconds_per_chunk:
                    time.sleep(state.seconds_per_chunk)
            return None

    return Handler


def _sha1(content: bytes) -> str:
    return hashlib.sha1(content).hexdigest()


@contextmanager
def model_file_server(state: ModelFileServer) -> Iterator[ModelFileServer]:
    """Serve `state` on a free loopback port until the block ends."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    server.daemon_threads = True
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def s3_server(*, check_credentials: bool = False) -> Iterator[str]:
    """moto's S3-compatible server as a separate process; yields its endpoint URL. With
    `check_credentials` it verifies keys like AWS does (and knows none)."""
    port = _free_port()
    env = dict(os.environ)
    if check_credentials:
        env["INITIAL_NO_AUTH_ACTION_COUNT"] = "0"
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(url + "/moto-api/", timeout=1)
                break
            except httpx.HTTPError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the S3 server did not start") from None
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)
