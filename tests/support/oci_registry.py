"""A real OCI registry on loopback (the `docker-registry` Debian package: the CNCF
distribution server), and pushes to it: with the `oras` client (an artifact whose layers
are files) or by hand (an image whose one layer is a tar, as `docker build` makes)."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.support.model_servers import _free_port

REGISTRY_BINARY = "docker-registry"
IMAGE_MANIFEST = "application/vnd.oci.image.manifest.v1+json"


@contextmanager
def oci_registry(root: Path) -> Iterator[str]:
    """`docker-registry serve` storing under `root`; yields `127.0.0.1:<port>`."""
    binary = shutil.which(REGISTRY_BINARY)
    if binary is None:
        pytest.fail(f"{REGISTRY_BINARY} is missing: run scripts/system-deps.sh")
    port = _free_port()
    config = root / "config.yml"
    config.write_text(
        "version: 0.1\nlog:\n  level: error\n"
        f"storage:\n  filesystem:\n    rootdirectory: {root / 'data'}\n"
        f"http:\n  addr: 127.0.0.1:{port}\n"
    )
    proc = subprocess.Popen(
        [binary, "serve", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    host = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"http://{host}/v2/", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the OCI registry did not start")
            time.sleep(0.1)
        yield host
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def push_with_oras(host: str, repository: str, tag: str, paths: list[Path]) -> str:
    """`oras push host/repository:tag PATH...`: a file is a layer titled with its name, a
    folder one tar.gz layer marked for unpacking; returns the reference."""
    import oras.provider

    reference = f"{host}/{repository}:{tag}"
    client = oras.provider.Registry(hostname=host, insecure=True)
    files = [str(p) for p in paths]
    response = client.push(target=reference, files=files, disable_path_validation=True, quiet=True)
    assert response.status_code == 201, response.text
    return reference


def push_image(host: str, repository: str, tag: str, layers: list[bytes]) -> str:
    """An image whose layers are the given tar (or tar.gz) blobs, untitled, by hand."""
    base = f"http://{host}/v2/{repository}"
    descriptors = [_upload(base, blob, "application/vnd.oci.image.layer.v1.tar+gzip")
                   for blob in layers]  # fmt: skip
    config = _upload(base, b"{}", "application/vnd.oci.image.config.v1+json")
    manifest = {"schemaVersion": 2, "mediaType": IMAGE_MANIFEST, "config": config,
                "layers": descriptors}  # fmt: skip
    put = httpx.put(
        f"{base}/manifests/{tag}",
        content=json.dumps(manifest).encode(),
        headers={"Content-Type": IMAGE_MANIFEST},
    )
    assert put.status_code == 201, put.text
    return f"{host}/{repository}:{tag}"


def _upload(base: str, blob: bytes, media_type: str) -> dict[str, object]:
    digest = "sha256:" + hashlib.sha256(blob).hexdigest()
    start = httpx.post(f"{base}/blobs/uploads/")
    assert start.status_code == 202, start.text
    location = start.headers["location"]
    if location.startswith("/"):
        location = base.split("/v2/", 1)[0] + location
    joiner = "&" if "?" in location else "?"
    put = httpx.put(f"{location}{joiner}digest={digest}", content=blob,
                    headers={"Content-Type": "application/octet-stream"})  # fmt: skip
    assert put.status_code == 201, put.text
    return {"mediaType": media_type, "digest": digest, "size": len(blob)}


@contextmanager
def token_gate(registry: str) -> Iterator[tuple[str, list[str]]]:
    """A front for `registry` that asks for a bearer token as Docker Hub and GHCR do: a
    request without one gets 401 and a `Bearer realm=..` challenge, `/token` hands an
    anonymous token out, and a request bearing it is passed to the registry. Yields
    `127.0.0.1:<port>` and the paths it was asked, in order."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from threading import Thread

    token = "anonymous-pull-token"
    asked: list[str] = []

    class Gate(BaseHTTPRequestHandler):
        def log_message(self, *_: object) -> None:
            pass

        def do_GET(self) -> None:
            asked.append(self.path)
            host = f"127.0.0.1:{self.server.server_address[1]}"
            if self.path.startswith("/token"):
                self._send(200, json.dumps({"token": token}).encode(), "application/json")
            elif self.headers.get("Authorization") != f"Bearer {token}":
                challenge = (f'Bearer realm="http://{host}/token",service="gate",'
                             'scope="repository:acme:pull"')  # fmt: skip
                self._send(401, b"{}", "application/json", {"WWW-Authenticate": challenge})
            else:
                accept = self.headers.get("Accept", "*/*")
                answer = httpx.get(
                    f"http://{registry}{self.path}",
                    headers={"Accept": accept},
                    follow_redirects=True,
                )
                kind = answer.headers.get("content-type", "application/octet-stream")
                self._send(answer.status_code, answer.content, kind)

        def _send(
            self, status: int, body: bytes, kind: str, extra: dict[str, str] | None = None
        ) -> None:
            self.send_response(status)
            for name, value in {"Content-Type": kind, **(extra or {})}.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Gate)
    server.daemon_threads = True
    Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}", asked
    finally:
        server.shutdown()
        server.server_close()
