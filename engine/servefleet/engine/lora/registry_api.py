"""The pull half of the OCI distribution API: a manifest and blobs, anonymously.

A registry that wants a token answers 401 with `WWW-Authenticate: Bearer realm=..,
service=.., scope=..`; the token is then asked of the realm without credentials (what a
public repository on Docker Hub, GHCR or Harbor grants) and the request sent once more.
No credentials are ever sent: the engine holds none for adapters (`api.lora_source`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

from servefleet.api.oci_reference import (
    ACCEPT_MANIFESTS,
    MAX_MANIFEST_BYTES,
    ImageReference,
    bearer_challenge,
    index_entry,
)
from servefleet.engine.fetch.errors import FetchError, http_error

TIMEOUT = httpx.Timeout(30.0, read=300.0)
CHUNK = 1 << 20


class RegistryClient:
    """Anonymous reads of one repository."""

    def __init__(self, image: ImageReference, what: str) -> None:
        self.image = image
        self.what = what
        self.base = image.base_url
        self._token: str | None = None

    def manifest(self) -> dict[str, Any]:
        """The image manifest (the first one an index lists: adapter files have no platform)."""
        found = self._manifest(self.image.reference)
        entry = index_entry(found)
        if entry == "":
            raise FetchError(f"{self.what}: an empty image index", permanent=True)
        return found if entry is None else self._manifest(entry)

    def _manifest(self, reference: str) -> dict[str, Any]:
        accept = ACCEPT_MANIFESTS
        body = bytearray()
        try:
            with self._stream(f"{self.base}/manifests/{reference}", accept) as response:
                for chunk in response.iter_bytes():
                    body += chunk
                    if len(body) > MAX_MANIFEST_BYTES:
                        raise FetchError(f"{self.what}: manifest over 4 MiB", permanent=True)
        except httpx.HTTPError as exc:
            raise FetchError(f"{self.what}: {exc}", permanent=False) from exc
        try:
            manifest = json.loads(body)
        except ValueError:
            raise FetchError(f"{self.what}: the manifest is not JSON", permanent=True) from None
        if not isinstance(manifest, dict):
            raise FetchError(f"{self.what}: the manifest is not an object", permanent=True)
        return manifest

    def download_blob(self, digest: str, target: Path, max_bytes: int) -> None:
        """The blob into `target`; past `max_bytes` (its declared size) a permanent error."""
        written = 0
        try:
            url = f"{self.base}/blobs/{digest}"
            with self._stream(url, "*/*") as response, target.open("wb") as out:
                for chunk in response.iter_bytes(CHUNK):
                    written += len(chunk)
                    if written > max_bytes:
                        raise FetchError(
                            f"{self.what}: blob {digest} is larger than the {max_bytes} bytes "
                            "its manifest declares",
                            permanent=True,
                        )
                    out.write(chunk)
        except httpx.HTTPError as exc:
            raise FetchError(f"{self.what}: blob {digest}: {exc}", permanent=False) from exc

    def _stream(self, url: str, accept: str) -> _Response:
        return _Response(self, url, accept)

    def token_for(self, challenge: str) -> None:
        """Ask the challenge's realm for an anonymous token."""
        fields = bearer_challenge(challenge)
        if fields is None:
            raise FetchError(
                f"{self.what}: the registry wants credentials ({challenge.split(' ')[0]}); "
                "adapters are pulled anonymously",
                permanent=True,
            )
        query = {k: v for k, v in fields.items() if k in ("service", "scope")}
        try:
            answer = httpx.get(fields["realm"], params=query, timeout=TIMEOUT)
        except httpx.HTTPError as exc:
            raise FetchError(f"{self.what}: token: {exc}", permanent=False) from exc
        if answer.status_code != 200:
            raise http_error(answer.status_code, f"{self.what} (anonymous token)")
        body = answer.json()
        self._token = body.get("token") or body.get("access_token")
        if not self._token:
            raise FetchError(f"{self.what}: the token answer holds no token", permanent=True)

    def headers(self, accept: str) -> dict[str, str]:
        headers = {"Accept": accept}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        return headers


class _Response:
    """A streamed GET that answers one bearer challenge; HTTP errors become FetchErrors."""

    def __init__(self, client: RegistryClient, url: str, accept: str) -> None:
        self._client, self._url, self._accept = client, url, accept
        self._http = httpx.Client(timeout=TIMEOUT, follow_redirects=True, trust_env=False)
        self._response: httpx.Response | None = None

    def __enter__(self) -> httpx.Response:
        try:
            for attempt in (1, 2):
                request = self._http.build_request(
                    "GET", self._url, headers=self._client.headers(self._accept)
                )
                response = self._http.send(request, stream=True)
                challenge = response.headers.get("www-authenticate", "")
                if response.status_code == 401 and attempt == 1 and challenge:
                    response.close()
                    self._client.token_for(challenge)
                    continue
                break
        except httpx.HTTPError as exc:
            self._http.close()
            raise FetchError(f"{self._client.what}: {exc}", permanent=False) from exc
        if response.status_code >= 400:
            response.close()
            self._http.close()
            raise http_error(response.status_code, self._client.what)
        self._response = response
        return response

    def __exit__(self, *_: object) -> None:
        if self._response is not None:
            self._response.close()
        self._http.close()
