"""Hugging Face Hub repositories (or a Hub-compatible mirror) through `huggingface_hub`.

`snapshot_download` into the partial folder (`local_dir`): it honours revision, token and
allow-patterns, and resumes its own `.incomplete` files after a crash. The token is the
HF_TOKEN variable the operator sets from the deployment's Secret. The file listing is
asked for first, on its own, because it gives the total for progress and because
`snapshot_download` turns "no access" into a vague "cannot be accessed" error.
"""

from __future__ import annotations

import os
from pathlib import Path

from huggingface_hub import HfApi, snapshot_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.hf_api import RepoFile
from huggingface_hub.utils import disable_progress_bars, filter_repo_objects

from servefleet.api.model_source import HuggingFaceSource
from servefleet.engine.fetch.errors import PERMANENT_HTTP_STATUSES, FetchError

TOKEN_ENV = "HF_TOKEN"


class HuggingFaceDownload:
    """One `HuggingFaceSource` into a folder."""

    def __init__(self, source: HuggingFaceSource) -> None:
        self.source = source
        self._token: str | bool = os.environ.get(TOKEN_ENV) or False
        disable_progress_bars()  # our own progress lines replace the tqdm bars

    def _what(self) -> str:
        where = f" at {self.source.endpoint}" if self.source.endpoint else ""
        return f"{self.source.repo}@{self.source.revision}{where}"

    def total_bytes(self) -> int | None:
        """Sum of the sizes the Hub lists for the files the patterns select."""
        api = HfApi(endpoint=self.source.endpoint, token=self._token)
        try:
            files = [
                f
                for f in api.list_repo_tree(
                    self.source.repo, revision=self.source.revision, recursive=True
                )
                if isinstance(f, RepoFile)
            ]
        except Exception as exc:
            raise self._error(exc) from exc
        chosen = filter_repo_objects(
            files, allow_patterns=self.source.allow_patterns or None, key=lambda f: f.path
        )
        return sum(f.size for f in chosen)

    def run(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        try:
            snapshot_download(
                repo_id=self.source.repo,
                revision=self.source.revision,
                token=self._token,
                allow_patterns=self.source.allow_patterns or None,
                local_dir=folder,
                endpoint=self.source.endpoint,
            )
        except Exception as exc:
            raise self._error(exc) from exc

    def _error(self, exc: BaseException) -> FetchError:
        """The Hub's error (the first in the exception chain) as a FetchError."""
        cause = _hub_error(exc)
        if isinstance(cause, GatedRepoError | RepositoryNotFoundError):
            return FetchError(
                f"{self._what()}: repository not found or not accessible with the given "
                f"token (HTTP {_status(cause)})",
                permanent=True,
            )
        if isinstance(cause, RevisionNotFoundError | EntryNotFoundError):
            return FetchError(f"{self._what()}: {_first_line(cause)}", permanent=True)
        if isinstance(cause, HfHubHTTPError):
            status = _status(cause)
            return FetchError(
                f"{self._what()}: HTTP {status}: {_first_line(cause)}",
                permanent=status in PERMANENT_HTTP_STATUSES,
            )
        # The transport's own errors (connection refused, timeouts): worth another try.
        return FetchError(f"{self._what()}: {_first_line(exc)}", permanent=False)


def _hub_error(exc: BaseException) -> BaseException:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, HfHubHTTPError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return exc


def _status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
