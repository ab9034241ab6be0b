"""The Batch API's two stores behind one interface (`BatchStore`): the folder and an
S3-compatible bucket (moto's server, a real HTTP S3 in its own process). The same cases run
on both: tenants apart, ids that are not ids name nothing, a file listed only once whole, open
batches, the journal a restarted runner resumes from; then what only the bucket has (its
prefix, crash orders, credentials), and a batch run end to end on the bucket."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import boto3
import openai
import pytest

from servefleet.api.batch_storage import BatchS3Store
from servefleet.api.batches import Batch, BatchConfig, RequestCounts
from servefleet.bench.fake_upstream import FakeBehaviour, FakeOpenAI
from servefleet.bench.processes import free_port, serve_in_thread
from servefleet.gateway import batch_store_s3
from servefleet.gateway.app import Gateway
from servefleet.gateway.batch_store import BatchStore, new_batch_id
from servefleet.gateway.batch_store_folder import FolderBatchStore
from servefleet.gateway.batch_store_s3 import S3BatchStore
from servefleet.gateway.batch_stores import open_store
from tests.support.model_servers import s3_server
from tests.test_gateway_batches import _config, _lines, _submit, _wait

BUCKET = "batches"
KEYS = {"AWS_ACCESS_KEY_ID": "test-key", "AWS_SECRET_ACCESS_KEY": "test-secret"}
_prefixes = itertools.count()


@pytest.fixture(scope="module")
def s3() -> Iterator[str]:
    with pytest.MonkeyPatch.context() as env:
        for key, value in KEYS.items():
            env.setenv(key, value)
        with s3_server() as endpoint:
            boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(
                Bucket=BUCKET
            )
            yield endpoint


def bucket_config(endpoint: str) -> BatchS3Store:
    """A prefix of its own per test: the bucket is shared by the module."""
    return BatchS3Store(
        bucket=BUCKET, endpoint=endpoint, region="us-east-1", prefix=f"t{next(_prefixes)}/"
    )


@pytest.fixture(params=["folder", "s3"])
def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], BatchStore]:
    """A store factory: each call is the same store opened again (a restarted gateway)."""
    if request.param == "folder":
        return lambda: FolderBatchStore(tmp_path)
    config = bucket_config(request.getfixturevalue("s3"))
    return lambda: S3BatchStore(config)


def _batch(tenant: str, created_at: int = 1, status: str = "in_progress") -> Batch:
    return Batch.model_validate(
        {
            "id": new_batch_id(),
            "endpoint": "/v1/chat/completions",
            "input_file_id": "file-x",
            "created_at": created_at,
            "expires_at": created_at + 86400,
            "status": status,
            "tenant": tenant,
            "request_counts": RequestCounts(total=3).model_dump(),
        }
    )


def test_tenants_see_only_their_own_files(make_store: Callable[[], BatchStore]) -> None:
    store = make_store()
    file = store.put_file("a", "in.jsonl", "batch", b"data")
    assert store.file("a", file.id) == file and store.file_content("a", file.id) == b"data"
    assert store.file("b", file.id) is None and store.file_content("b", file.id) is None
    assert store.delete_file("b", file.id) is False
    assert store.files("b") == [] and [f.id for f in store.files("a")] == [file.id]
    for not_an_id in ("../a/files/" + file.id, file.id + "/..", "a/files/" + file.id, ""):
        assert store.file("b", not_an_id) is None and store.file("a", not_an_id) is None
    with pytest.raises(ValueError, match="tenant"):
        store.files("../a")
    assert store.delete_file("a", file.id) is True
    assert store.file("a", file.id) is None and store.files("a") == []


def test_batches_are_per_tenant_and_open_until_closed(make_store: Callable[[], BatchStore]) -> None:
    store = make_store()
    older, newer, theirs = _batch("a", 1), _batch("a", 2), _batch("b", 3)
    for batch in (older, newer, theirs):
        store.save_batch(batch)
    assert [b.id for b in store.batches("a")] == [newer.id, older.id]  # newest first
    assert store.batch("b", older.id) is None and store.batches("c") == []
    assert [b.id for b in make_store().open_batches()] == [older.id, newer.id, theirs.id]
    newer.status = "completed"
    store.save_batch(newer)
    assert [b.id for b in make_store().open_batches()] == [older.id, theirs.id]
    assert store.batch("a", newer.id).status == "completed"  # type: ignore[union-attr]


def test_the_journal_survives_a_restart(make_store: Callable[[], BatchStore]) -> None:
    store, batch = make_store(), _batch("a")
    store.save_batch(batch)
    for index in (2, 0):
        store.append_result(batch, {"index": index, "status": 200, "body": {"n": index}})
    found = make_store().results(batch)
    assert sorted((r["index"], r["body"]["n"]) for r in found) == [(0, 0), (2, 2)]
    assert make_store().results(_batch("a")) == []


def test_the_bucket_holds_only_keys_under_the_prefix_and_tenant(s3: str) -> None:
    config = bucket_config(s3)
    store = S3BatchStore(config)
    file = store.put_file("a", "../../evil", "batch", b"x")  # a filename is data, not a key
    batch = _batch("a")
    store.save_batch(batch)
    store.append_result(batch, {"index": 7, "status": 200})
    with pytest.raises(ValueError, match="index"):
        store.append_result(batch, {"index": "../x", "status": 200})
    client = boto3.client("s3", endpoint_url=s3, region_name="us-east-1")
    keys = {o["Key"] for o in client.list_objects_v2(Bucket=BUCKET)["Contents"]}
    mine = {k for k in keys if k.startswith(config.prefix)}
    base = config.prefix + "tenants/a/"
    assert mine == {
        f"{base}files/{file.id}.data",
        f"{base}files/{file.id}.json",
        f"{base}batches/{batch.id}.json",
        f"{base}batches/{batch.id}.journal/000000007.json",
        f"{config.prefix}open/a/{batch.id}",
    }


def test_a_crash_mid_write_leaves_nothing_half_made_in_the_bucket(
    s3: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = S3BatchStore(bucket_config(s3))
    put, delete = store._put, store._delete

    def crash_on(suffix: str, real: Callable[..., None]) -> Callable[..., None]:
        def maybe(key: str, *data: bytes) -> None:
            if key.endswith(suffix):
                raise ConnectionError("the gateway died")
            real(key, *data)

        return maybe

    # The bytes written, the object not yet: no file to list, read or delete.
    monkeypatch.setattr(store, "_put", crash_on(".json", put))
    with pytest.raises(ConnectionError):
        store.put_file("a", "in.jsonl", "batch", b"data")
    monkeypatch.setattr(store, "_put", put)
    assert store.files("a") == []
    # A batch closed, its open marker not yet deleted: not the runner's work, and cleaned.
    batch = _batch("a")
    store.save_batch(batch)
    batch.status = "completed"
    monkeypatch.setattr(store, "_delete", crash_on(batch.id, delete))
    with pytest.raises(ConnectionError):
        store.save_batch(batch)
    monkeypatch.setattr(store, "_delete", delete)
    assert store.open_batches() == [] and store.open_batches() == []


def test_the_bucket_store_refuses_to_start_without_credentials(
    s3: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in KEYS:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(ValueError, match="AWS_ACCESS_KEY_ID"):
        open_store(BatchConfig(s3=bucket_config(s3)))


@pytest.mark.parametrize(
    "fields", [{}, {"store_dir": "/x", "s3": {"bucket": "abc"}}], ids=["none", "both"]
)
def test_the_config_names_exactly_one_store(fields: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="exactly one store"):
        BatchConfig.model_validate(fields)


def test_a_batch_runs_on_the_bucket_and_stays_its_tenants(s3: str, tmp_path: Path) -> None:
    """The gateway with `batch.s3`: the official client's calls, the output from the journal,
    and another tenant's ids answered 404 as ids that do not exist."""
    config = _config(tmp_path).model_copy(
        update={"batch": BatchConfig(s3=bucket_config(s3), retry_seconds=0.2)}
    )
    with ExitStack() as stack:
        url = stack.enter_context(serve_in_thread(FakeOpenAI(FakeBehaviour(completion_tokens=3))))
        gateway = Gateway(config)
        gateway.set_replicas("d", [url], ready=[url])
        base = stack.enter_context(serve_in_thread(gateway))
        mine, theirs = (
            openai.OpenAI(base_url=base + "/v1", api_key=f"key-{t}", max_retries=0)
            for t in ("a", "b")
        )
        batch = _submit(mine, _lines(5))
        for call in (
            lambda: theirs.batches.retrieve(batch.id),
            lambda: theirs.batches.cancel(batch.id),
            lambda: theirs.files.content(batch.input_file_id),
            lambda: theirs.files.delete(batch.input_file_id),
        ):
            with pytest.raises(openai.NotFoundError):
                call()
        done = _wait(mine, batch.id, {"completed"})
        assert done.request_counts.completed == 5
        output = mine.files.content(done.output_file_id).text.splitlines()
        assert len(output) == 5 and '"req-0"' in output[0]
        with pytest.raises(openai.NotFoundError):
            theirs.files.content(done.output_file_id)
    assert not (tmp_path / "tenants").exists()  # nothing went to a folder


def test_a_bucket_that_cannot_be_reached_is_a_503_and_the_runner_keeps_polling(
    s3: str, tmp_path: Path
) -> None:
    """The store is down (an endpoint nobody listens on): the API says 503 with Retry-After,
    never a 500, and the runner's task survives its polls to come back when the bucket does."""
    dead = BatchS3Store(
        bucket=BUCKET, endpoint=f"http://127.0.0.1:{free_port()}", region="us-east-1"
    )
    config = _config(tmp_path).model_copy(update={"batch": BatchConfig(s3=dead, retry_seconds=0.2)})
    with ExitStack() as stack:
        gateway = Gateway(config)
        base = stack.enter_context(serve_in_thread(gateway))
        client = openai.OpenAI(base_url=base + "/v1", api_key="key-a", max_retries=0)
        for call in (client.files.list, client.batches.list):
            with pytest.raises(openai.InternalServerError) as refused:
                call()
            assert refused.value.status_code == 503
            assert refused.value.response.headers["retry-after"] == "5"
            assert "store_unavailable" in refused.value.response.text
        runner = gateway._batch_task
        assert runner is not None and not runner.done(), "the runner died with the bucket"


def test_a_long_journal_reads_back_in_few_objects(s3: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every SEGMENT_RECORDS lines journaled become one object: a restarted runner reads 50
    lines in 12 GETs, not 50; a line left twice by a crash between a segment's PUT and the
    deletes of its lines' own objects is read back once."""
    monkeypatch.setattr(batch_store_s3, "SEGMENT_RECORDS", 20)
    config = bucket_config(s3)
    store, batch = S3BatchStore(config), _batch("a")
    store.save_batch(batch)
    for index in reversed(range(50)):  # lines finish in any order
        store.append_result(batch, {"index": index, "status": 200, "body": {"n": index}})
    journal = store._journal(batch)
    client = boto3.client("s3", endpoint_url=s3, region_name="us-east-1")
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=BUCKET, Prefix=journal)["Contents"]]
    assert sum(k.endswith(".jsonl") for k in keys) == 2 and len(keys) == 12
    store._put(journal + "000000049.json", b'{"index":49,"status":200,"body":{"n":49}}')
    restarted, gets = S3BatchStore(config), []
    real_get = restarted._get
    monkeypatch.setattr(restarted, "_get", lambda key: gets.append(key) or real_get(key))
    found = restarted.results(batch)
    assert sorted((r["index"], r["body"]["n"]) for r in found) == [(i, i) for i in range(50)]
    assert len(gets) == 13  # 2 segments, 10 lines not yet folded, the line left twice
