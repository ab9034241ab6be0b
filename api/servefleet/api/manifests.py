"""Reading LLMDeployments, LLMAdapters (and the Secrets keys point at) from YAML files.

Local mode serves the same multi-document YAML that `kubectl apply` takes, so one
file can hold a demo Secret next to the LLMDeployment that references it, and the
LLMAdapters served on it.
"""

from __future__ import annotations

import base64
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from servefleet.api.llmadapter import ADAPTER_KIND, LLMAdapter
from servefleet.api.llmdeployment import FULL_API_VERSION, KIND, LLMDeployment, SecretKeyRef


class ManifestError(ValueError):
    """A manifest file that cannot be used; the message names the file and document."""


def _documents(path: Path) -> list[tuple[int, dict[str, Any]]]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ManifestError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    try:
        raw_docs = list(yaml.safe_load_all(text))
    except yaml.YAMLError as exc:
        raise ManifestError(f"{path}: not valid YAML: {exc}") from exc
    docs = []
    for index, doc in enumerate(raw_docs, start=1):
        if doc is None:
            continue
        if not isinstance(doc, dict):
            raise ManifestError(f"{path}: document {index} is not a mapping")
        docs.append((index, doc))
    return docs


def _format_error(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(document)"
        message = err["msg"].removeprefix("Value error, ")
        lines.append(f"  {where}: {message}")
    return "\n".join(lines)


def parse_llmdeployment(doc: Mapping[str, Any], source: str = "object") -> LLMDeployment:
    """Validate one LLMDeployment document; errors list every bad field by path."""
    try:
        return LLMDeployment.model_validate(dict(doc))
    except ValidationError as exc:
        raise ManifestError(f"{source}: invalid LLMDeployment:\n{_format_error(exc)}") from exc


def parse_llmadapter(doc: Mapping[str, Any], source: str = "object") -> LLMAdapter:
    """Validate one LLMAdapter document; errors list every bad field by path."""
    try:
        return LLMAdapter.model_validate(dict(doc))
    except ValidationError as exc:
        raise ManifestError(f"{source}: invalid LLMAdapter:\n{_format_error(exc)}") from exc


def _of_kind(file: Path, kind: str) -> list[tuple[str, dict[str, Any]]]:
    """(where, document) for each document of `kind`; other kinds are skipped, but every
    document must say what it is and ours must be our apiVersion."""
    found = []
    for index, doc in _documents(file):
        doc_kind = doc.get("kind")
        if doc_kind != kind:
            if not isinstance(doc_kind, str) or not doc.get("apiVersion"):
                raise ManifestError(f"{file}: document {index} has no apiVersion/kind")
            continue
        if doc.get("apiVersion") != FULL_API_VERSION:
            raise ManifestError(
                f"{file}: document {index}: apiVersion {doc.get('apiVersion')!r}, "
                f"expected {FULL_API_VERSION!r}"
            )
        name = (doc.get("metadata") or {}).get("name", "?")
        found.append((f"{file}: document {index} ({kind} {name})", doc))
    return found


def _refuse_twins(file: Path, kind: str, keys: list[tuple[str, str]]) -> None:
    seen: set[tuple[str, str]] = set()
    for namespace, name in keys:
        if (namespace, name) in seen:
            raise ManifestError(f"{file}: {kind} {namespace}/{name} appears twice")
        seen.add((namespace, name))


def load_llmdeployments(path: str | os.PathLike[str]) -> list[LLMDeployment]:
    """Every LLMDeployment in a (multi-document) YAML file; other kinds (Secrets,
    LLMAdapters) are skipped.

    Raises ManifestError naming the document and the field paths at fault, and when
    the file holds no LLMDeployment or two share a namespace/name.
    """
    file = Path(path)
    found = [parse_llmdeployment(doc, where) for where, doc in _of_kind(file, KIND)]
    if not found:
        raise ManifestError(f"{file}: no {KIND} documents found")
    _refuse_twins(file, KIND, [(dep.namespace, dep.name) for dep in found])
    return found


def load_llmadapters(path: str | os.PathLike[str]) -> list[LLMAdapter]:
    """Every LLMAdapter in a (multi-document) YAML file, none being an empty list (a file
    of deployments alone serves no adapter); other kinds are skipped.

    Raises ManifestError naming the document and the field paths at fault, and when two
    share a namespace/name.
    """
    file = Path(path)
    found = [parse_llmadapter(doc, where) for where, doc in _of_kind(file, ADAPTER_KIND)]
    _refuse_twins(file, ADAPTER_KIND, [(a.namespace, a.name) for a in found])
    return found


def load_secrets(path: str | os.PathLike[str]) -> dict[tuple[str, str], str]:
    """Secret documents of a file as {(name, key): value} (data is base64, stringData plain)."""
    values: dict[tuple[str, str], str] = {}
    file = Path(path)
    for index, doc in _documents(file):
        if doc.get("kind") != "Secret":
            continue
        name = (doc.get("metadata") or {}).get("name")
        if not isinstance(name, str):
            raise ManifestError(f"{file}: document {index}: Secret without metadata.name")
        for key, encoded in (doc.get("data") or {}).items():
            try:
                values[(name, key)] = base64.b64decode(str(encoded), validate=True).decode()
            except (ValueError, UnicodeDecodeError) as exc:
                raise ManifestError(
                    f"{file}: document {index}: Secret {name} data.{key} is not base64 text"
                ) from exc
        for key, plain in (doc.get("stringData") or {}).items():
            values[(name, key)] = str(plain)
    return values


def secret_env_name(ref: SecretKeyRef) -> str:
    """Environment variable that stands in for a Secret key in local mode:
    SERVEFLEET_SECRET_<NAME>_<KEY>, upper-cased, other characters as '_'."""
    return "SERVEFLEET_SECRET_" + re.sub(r"[^A-Za-z0-9]", "_", f"{ref.name}_{ref.key}").upper()


def resolve_secret(
    ref: SecretKeyRef,
    secrets: Mapping[tuple[str, str], str],
    environ: Mapping[str, str] | None = None,
) -> str | None:
    """A Secret key's value in local mode: the environment variable wins over the file."""
    env = os.environ if environ is None else environ
    return env.get(secret_env_name(ref), secrets.get((ref.name, ref.key)))
