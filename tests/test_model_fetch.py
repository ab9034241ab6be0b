"""Model downloads against real local servers: plain HTTP, a Hub-compatible file API and
an S3-compatible server (moto, its own process). Never the internet."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest

from servefleet.api.fetch_progress import FetchProgress, parse_line
from servefleet.api.model_source import ModelSource
from servefleet.engine.fetch import FetchError, fetch_model, fetch_until_done
from servefleet.engine.fetch import progress as fetch_progress
from servefleet.engine.fetch.cache import PARTIAL_DIR
from servefleet.engine.fetch.fetcher import RetryPolicy
from servefleet.engine.fetch.progress import ProgressLog
from tests.support.model_servers import HubRepo, ModelFileServer, model_file_server, s3_server

ROOT = Path(__file__).resolve().parents[1]
WEIGHTS = os.urandom(3 * 1024 * 1024 + 123)


class Lines(list[str]):
    """Collects what the fetcher logs."""

    def reports(self) -> list[FetchProgress]:
        return [r for r in map(parse_line, self) if r is not None]


@pytest.fixture(scope="module")
def files() -> Iterator[ModelFileServer]:
    state = ModelFileServer(files={"model.gguf": WEIGHTS, "small.gguf": WEIGHTS[:4096]})
    with model_file_server(state) as server:
        yield server


def url_source(server: ModelFileServer, name: str) -> ModelSource:
    return ModelSource(url=f"{server.url}/files/{name}?sig=1")


def test_the_final_progress_line_is_never_overtaken_by_a_stale_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The thread measured 0 bytes and is slow to log it while the caller logs the final
    size: the caller's line must still come last (it once did not, now and then)."""
    measured, release = threading.Event(), threading.Event()

    def folder_bytes(_: Path) -> int:
        if not measured.is_set():  # the thread's first look: the download has not begun
            measured.set()
            release.wait(5)
            return 0
        return 100

    monkeypatch.setattr(fetch_progress, "folder_bytes", folder_bytes)
    lines = Lines()
    with ProgressLog(tmp_path, 100, lines.append, interval=0.001) as log:
        assert measured.wait(5)
        caller = threading.Thread(target=log.report)
        caller.start()
        time.sleep(0.05)  # the caller now waits for the thread's line (or, unlocked, logs first)
        release.set()
        caller.join(5)
    assert [r.done_bytes for r in lines.reports()] == [0, 100]


# --------------------------------------------------------------------------- plain HTTP


def test_http_fetch_reports_progress_then_hits_the_cache(
    files: ModelFileServer, tmp_path: Path
) -> None:
    source = url_source(files, "model.gguf")
    lines = Lines()
    result = fetch_model(source, tmp_path, emit=lines.append, progress_interval=0.01)
    assert result.downloaded
    assert result.path == tmp_path / source.fetched_path()
    assert result.path.name == "model.gguf"
    assert result.path.read_bytes() == WEIGHTS
    reports = lines.reports()
    assert reports[-1].state == "done"
    assert reports[-1].done_bytes == reports[-1].total_bytes == len(WEIGHTS)
    progress = [r for r in reports if r.state == "progress"]
    assert progress and all(r.total_bytes == len(WEIGHTS) for r in progress)
    assert progress[-1].done_bytes == len(WEIGHTS)
    assert not (tmp_path / PARTIAL_DIR / source.cache_entry()).exists()

    before = list(files.requests)
    again = Lines()
    second = fetch_model(source, tmp_path, emit=again.append, progress_interval=0.01)
    assert not second.downloaded
    assert files.requests == before  # a cache hit asks the server nothing
    assert [r.state for r in again.reports()] == ["done"]
    assert "already in the cache" in again[-1]


def test_http_resumes_a_cut_off_download(files: ModelFileServer, tmp_path: Path) -> None:
    source = url_source(files, "model.gguf")
    partial = tmp_path / PARTIAL_DIR / source.cache_entry()
    partial.mkdir(parents=True)
    half = len(WEIGHTS) // 2
    # Zeros where the first half was: only a ranged request keeps them.
    (partial / "model.gguf").write_bytes(bytes(half))
    sent_before = files.body_bytes.get("/files/model.gguf", 0)
    result = fetch_model(source, tmp_path, emit=lambda _: None)
    assert result.path.read_bytes() == bytes(half) + WEIGHTS[half:]
    assert ("GET", "/files/model.gguf?sig=1", f"bytes={half}-") in files.requests
    assert files.body_bytes["/files/model.gguf"] - sent_before == len(WEIGHTS) - half


@pytest.mark.parametrize(
    ("name", "cause"), [("missing.gguf", "HTTP 404"), ("private/model.gguf", "HTTP 401")]
)
def test_http_failure_is_a_clear_permanent_error(
    files: ModelFileServer, tmp_path: Path, name: str, cause: str
) -> None:
    lines = Lines()
    slept: list[float] = []
    policy = RetryPolicy(first=1.0, permanent=120.0, attempts=2)
    with pytest.raises(FetchError) as caught:
        fetch_until_done(
            url_source(files, name), tmp_path, policy, emit=lines.append, sleep=slept.append
        )
    assert caught.value.permanent
    assert cause in caught.value.message
    assert slept == [120.0]  # a permanent failure waits the long interval, no tight loop
    failed = lines.reports()
    assert [r.state for r in failed] == ["failed", "failed"]
    assert cause in failed[0].message and "next try in 120s" in failed[0].message
    assert "giving up" in failed[1].message


def test_two_processes_share_one_download(files: ModelFileServer, tmp_path: Path) -> None:
    """Two pods on one cache: one downloads, the other waits on the lock and reuses it."""
    files.seconds_per_chunk = 0.01
    source = url_source(files, "model.gguf").model_copy(
        update={"url": f"{files.url}/files/model.gguf?concurrent=1"}
    )
    gets_before = files.gets("concurrent=1")
    command = [
        sys.executable, "-m", "servefleet.cli.main", "model", "fetch",
        "--source", source.model_dump_json(exclude_none=True),
        "--cache", str(tmp_path), "--progress-seconds", "0.2",
    ]  # fmt: skip
    try:
        procs = [
            subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=ROOT) for _ in range(2)
        ]
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        files.seconds_per_chunk = 0.0
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert files.gets("concurrent=1") - gets_before == 1
    done = sorted(out.strip().splitlines()[-1] for out in outputs)
    assert "already in the cache" in done[0] and "downloaded" in done[1]
    assert (tmp_path / source.fetched_path()).read_bytes() == WEIGHTS


def test_cli_reports_a_failure_and_exits_when_attempts_run_out(
    files: ModelFileServer, tmp_path: Path
) -> None:
    source = url_source(files, "missing.gguf")
    done = subprocess.run(
        [
            sys.executable, "-m", "servefleet.cli.main", "model", "fetch",
            "--source", source.model_dump_json(exclude_none=True),
            "--cache", str(tmp_path), "--attempts", "1",
        ],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1
    report = parse_line(done.stdout.strip().splitlines()[-1])
    assert report is not None and report.state == "failed"
    assert "HTTP 404" in report.message


# --------------------------------------------------------------------------- Hugging Face

HUB_FILES = {
    "config.json": b'{"model_type": "llama"}',
    "model.safetensors": os.urandom(1024 * 1024),
    "tokenizer.json": b'{"version": "1.0"}',
    "README.md": b"# not needed",
}


@pytest.fixture(scope="module")
def hub() -> Iterator[ModelFileServer]:
    state = ModelFileServer(
        repos={
            "acme/tiny": HubRepo(files=HUB_FILES),
            "acme/gated": HubRepo(files=HUB_FILES, token="hf_right"),
        }
    )
    with model_file_server(state) as server:
        yield server


@pytest.fixture
def online(monkeypatch: pytest.MonkeyPatch) -> None:
    """The suite runs with HF_HUB_OFFLINE=1 (nothing reaches the real Hub); these tests
    talk to the local Hub-compatible server only."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.delenv("HF_TOKEN", raising=False)


def hub_source(server: ModelFileServer, repo: str, **extra: object) -> ModelSource:
    spec = {"repo": repo, "endpoint": server.url, "allowPatterns": ["*.json", "*.safetensors"]}
    return ModelSource.model_validate({"huggingface": spec | extra})


@pytest.mark.usefixtures("online")
def test_hub_fetch_with_token_patterns_and_revision(
    hub: ModelFileServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_right")
    commit = HubRepo(files={}).commit
    source = hub_source(hub, "acme/gated", revision=commit)
    lines = Lines()
    result = fetch_model(source, tmp_path, emit=lines.append, progress_interval=0.01)
    assert result.downloaded
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (result.path / name).read_bytes() == HUB_FILES[name]
    assert not (result.path / "README.md").exists()
    wanted = sum(len(HUB_FILES[n]) for n in ("config.json", "model.safetensors", "tokenizer.json"))
    progress = [r for r in lines.reports() if r.state == "progress"]
    assert progress and progress[0].total_bytes == wanted
    assert any(p == f"/acme/gated/resolve/{commit}/model.safetensors" for _, p, _ in hub.requests)

    before = len(hub.requests)
    assert not fetch_model(source, tmp_path, emit=lambda _: None).downloaded
    assert len(hub.requests) == before


@pytest.mark.usefixtures("online")
@pytest.mark.parametrize(
    ("repo", "token", "extra", "cause"),
    [
        ("acme/gated", "hf_wrong", {}, "not accessible with the given token"),
        ("acme/gated", None, {}, "not accessible with the given token"),
        ("acme/absent", None, {}, "not found"),
        ("acme/tiny", None, {"revision": "v9"}, "acme/tiny@v9"),
    ],
)
def test_hub_auth_and_missing_revision_are_clear_permanent_errors(
    hub: ModelFileServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    repo: str,
    token: str | None,
    extra: dict[str, object],
    cause: str,
) -> None:
    if token:
        monkeypatch.setenv("HF_TOKEN", token)
    with pytest.raises(FetchError) as caught:
        fetch_model(hub_source(hub, repo, **extra), tmp_path, emit=lambda _: None)
    assert caught.value.permanent, caught.value.message
    assert cause in caught.value.message


# --------------------------------------------------------------------------- S3-compatible

OBJECTS = {
    "llama/config.json": b'{"model_type": "llama"}',
    "llama/model.safetensors": os.urandom(2 * 1024 * 1024 + 7),
    "llama/tokenizer/tokenizer.json": b"{}",
    "gguf/model.Q4_1.gguf": WEIGHTS,
}


@pytest.fixture(scope="module")
def s3() -> Iterator[str]:
    keys = {"AWS_ACCESS_KEY_ID": "test-key", "AWS_SECRET_ACCESS_KEY": "test-secret"}
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update(keys)
    try:
        with s3_server() as endpoint:
            client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
            client.create_bucket(Bucket="models")
            for key, body in OBJECTS.items():
                client.put_object(Bucket="models", Key=key, Body=body)
            yield endpoint
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def s3_source(endpoint: str, url: str) -> ModelSource:
    return ModelSource.model_validate(
        {"s3": {"url": url, "endpoint": endpoint, "region": "us-east-1"}}
    )


def test_s3_folder_fetch_then_cache_hit(s3: str, tmp_path: Path) -> None:
    source = s3_source(s3, "s3://models/llama/")
    lines = Lines()
    result = fetch_model(source, tmp_path, emit=lines.append, progress_interval=0.01)
    assert result.downloaded and result.path.is_dir()
    for key, body in OBJECTS.items():
        if key.startswith("llama/"):
            assert (result.path / key.removeprefix("llama/")).read_bytes() == body
    total = sum(len(b) for k, b in OBJECTS.items() if k.startswith("llama/"))
    assert lines.reports()[-1].done_bytes == total
    assert next(r.total_bytes for r in lines.reports() if r.state == "progress") == total

    again = Lines()
    assert not fetch_model(source, tmp_path, emit=again.append).downloaded
    assert [r.state for r in again.reports()] == ["done"]


def test_s3_single_object_resumes(s3: str, tmp_path: Path) -> None:
    source = s3_source(s3, "s3://models/gguf/model.Q4_1.gguf")
    partial = tmp_path / PARTIAL_DIR / source.cache_entry()
    partial.mkdir(parents=True)
    half = len(WEIGHTS) // 2
    (partial / "model.Q4_1.gguf").write_bytes(bytes(half))
    result = fetch_model(source, tmp_path, emit=lambda _: None)
    assert result.path == tmp_path / source.cache_entry() / "model.Q4_1.gguf"
    assert result.path.read_bytes() == bytes(half) + WEIGHTS[half:]


@pytest.mark.parametrize(
    ("url", "cause"),
    [("s3://models/gguf/absent.gguf", "404"), ("s3://no-such-bucket/x/", "NoSuchBucket")],
)
def test_s3_missing_object_or_bucket_is_permanent(
    s3: str, tmp_path: Path, url: str, cause: str
) -> None:
    with pytest.raises(FetchError) as caught:
        fetch_model(s3_source(s3, url), tmp_path, emit=lambda _: None)
    assert caught.value.permanent
    assert cause in caught.value.message


def test_s3_wrong_credentials_are_a_clear_permanent_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONG")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with s3_server(check_credentials=True) as endpoint, pytest.raises(FetchError) as caught:
        fetch_model(s3_source(endpoint, "s3://models/llama/"), tmp_path, emit=lambda _: None)
    assert caught.value.permanent
    assert "InvalidAccessKeyId" in caught.value.message
