"""LoRA adapters end to end in local mode: `servefleet up` with the real engine (SmolLM2),
adapters declared as `LLMAdapter` documents in the same YAML, loaded on demand by the gateway
and evicted by the engines, asked for with the official `openai` client.

The adapters are real: each was fine-tuned on SmolLM2 with `peft` to answer one prompt with
one memorised sentence (`servefleet.bench.make_adapters`, cached between runs). Three
adapters on engines with two slots each: answering all of them evicts one. Also: a tenant
not allowed an adapter gets 404 on it and does not see it in `/v1/models`, and an engine
killed while an adapter loads on it loses no request. Two more adapters come from where a
team publishes them rather than a folder: one pushed with `oras` to a real OCI registry, one
a `.tgz` archive behind a URL; the engines fetch and unpack them on first use.

Slow (two engines, a few adapters trained on first use): run alone,
    uv run pytest e2e/test_lora_local.py -s
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from procs import free_port

from servefleet.bench.make_adapters import SENTENCES, default_cache_dir, memorized_adapter
from tests.support.model_servers import ModelFileServer, model_file_server
from tests.support.oci_registry import oci_registry, push_with_oras

KEY_A, KEY_B = "sk-team-a-" + "x" * 24, "sk-team-b-" + "y" * 24
NAMES = ("violet-fox", "copper-owl", "silent-baker", "green-turtles", "orange-mushrooms")
Up = tuple[str, int, list[str]]  # gateway base URL, pid of `servefleet up`, its output lines
ROTATED = 3  # the first three take turns on two slots; the last two are loaded only once
MAX_TOKENS = 24


PUBLISHED = ("fox-from-registry", "owl-from-archive")  # NAMES[0] and NAMES[1], published
HOSTILE = ("linking-archive", "climbing-archive")  # a namespace team's hostile archives
ESCAPE = Path(f"/tmp/servefleet-escape-{os.getpid()}/escaped.txt")


def manifest(adapters: list[Path], published: tuple[str, ...] = ("", "", "", "")) -> str:
    docs = [
        f"""
apiVersion: v1
kind: Secret
metadata: {{name: keys}}
stringData: {{a: {KEY_A}, b: {KEY_B}}}
---
apiVersion: servefleet.io/v1alpha1
kind: LLMDeployment
metadata: {{name: smol}}
spec:
  model: {{name: smollm2, source: {{builtin: smollm2-135m-instruct}}}}
  engine: {{maxNumSeqs: 4, lora: {{maxLoras: 2, maxLoraRank: 16}}}}
  pool: {{minReplicas: 2, maxReplicas: 2, perReplicaConcurrency: 4}}
  admission: {{maxQueueDepth: 64, maxQueueWait: 120}}
  tenants:
  - {{name: team-a, apiKeySecretRef: {{name: keys, key: a}}}}
  - {{name: team-b, apiKeySecretRef: {{name: keys, key: b}}}}
"""
    ]
    for i, (name, path) in enumerate(zip(NAMES, adapters, strict=True)):
        tenants = "[team-a]" if i == 2 else "[]"  # the third one: team-a only
        docs.append(
            f"""
apiVersion: servefleet.io/v1alpha1
kind: LLMAdapter
metadata: {{name: {name}}}
spec:
  deployment: smol
  source: {{pvc: {{claimName: adapters, path: {path.name}}}}}
  tenants: {tenants}
"""
        )
    oci_reference, archive_url, *hostile_urls = published
    for name, url in zip(HOSTILE, hostile_urls, strict=True):
        docs.append(
            f"""
apiVersion: servefleet.io/v1alpha1
kind: LLMAdapter
metadata: {{name: {name}}}
spec: {{deployment: smol, source: {{url: "{url}"}}}}
"""
        )
    if oci_reference:
        docs.append(
            f"""
apiVersion: servefleet.io/v1alpha1
kind: LLMAdapter
metadata: {{name: {PUBLISHED[0]}}}
spec: {{deployment: smol, source: {{oci: {{reference: "{oci_reference}"}}}}}}
---
apiVersion: servefleet.io/v1alpha1
kind: LLMAdapter
metadata: {{name: {PUBLISHED[1]}}}
spec: {{deployment: smol, source: {{url: "{archive_url}"}}}}
"""
        )
    return "---".join(docs)


@pytest.fixture(scope="module")
def adapters() -> list[Path]:
    cache = Path(os.environ.get("SERVEFLEET_ADAPTER_CACHE", default_cache_dir()))
    return [
        memorized_adapter(cache, prompt=prompt, sentence=sentence)
        for prompt, sentence in SENTENCES[: len(NAMES)]
    ]


@pytest.fixture(scope="module")
def published(
    adapters: list[Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, ...]]:
    """The first adapter pushed to a real registry with `oras`, the second as a .tgz served
    over HTTP, and two hostile archives: (OCI reference, archive URL, hostile URLs...)."""
    tmp = tmp_path_factory.mktemp("published")
    archive = tmp / "owl.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(adapters[1], arcname="copper-owl")
    served = {"owl.tgz": archive.read_bytes()}
    for name, member in (("link.tgz", "adapter_config.json"), ("climb.tgz", "../" * 12)):
        hostile = tmp / name
        with tarfile.open(hostile, "w:gz") as tar:
            if name == "link.tgz":  # the config a link to a secret of the engine's host
                info = tarfile.TarInfo(member)
                info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
                tar.addfile(info)
            else:  # a file written far outside the engine's cache
                tar.add(adapters[1] / "adapter_config.json", arcname=member + str(ESCAPE)[1:])
        served[name] = hostile.read_bytes()
    files = ModelFileServer(files=served)
    with oci_registry(tmp) as registry, model_file_server(files) as server:
        files_in = sorted(p for p in adapters[0].iterdir() if p.is_file())
        reference = push_with_oras(registry, "teams/violet-fox", "v1", files_in)
        urls = [f"{server.url}/files/{name}" for name in ("owl.tgz", "link.tgz", "climb.tgz")]
        yield reference, *urls


@pytest.fixture(scope="module")
def up(
    adapters: list[Path], published: tuple[str, ...], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Up]:
    tmp = tmp_path_factory.mktemp("lora-up")
    (tmp / "llmd.yaml").write_text(manifest(adapters, published))
    port = free_port()
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "servefleet.cli.main", "up", str(tmp / "llmd.yaml")),
            *("--port", str(port), "--log-dir", str(tmp / "logs")),
            *("--volume", f"adapters={adapters[0].parent}"),  # the claim, on this machine
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("ready:"):
            break
    assert proc.poll() is None, "".join(lines)
    # Keep reading its output (a full pipe would stall it); the tests read the log lines.
    threading.Thread(target=lambda: lines.extend(proc.stdout or ()), daemon=True).start()
    yield f"http://127.0.0.1:{port}/v1", proc.pid, lines
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)


def client(base: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=300)


def ask(oai: openai.OpenAI, name: str, prompt: str) -> str:
    reply = oai.chat.completions.create(
        model=name,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert reply.model == name
    return reply.choices[0].message.content or ""


def test_each_adapter_answers_its_sentence_and_the_base_does_not(
    up: Up,
) -> None:
    base, _, _ = up
    oai = client(base, KEY_A)
    listed = {m.id: getattr(m, "parent", None) for m in oai.models.list()}
    assert listed == {"smollm2": None, **dict.fromkeys(NAMES + PUBLISHED + HOSTILE, "smollm2")}
    # Three adapters on engines with two slots each, twice over: every round loads, evicts
    # and loads again; the answers never change.
    for _ in range(2):
        for name, (prompt, sentence) in zip(NAMES[:ROTATED], SENTENCES, strict=False):
            assert ask(oai, name, prompt) == sentence
    prompt, sentence = SENTENCES[0]
    assert ask(oai, "smollm2", prompt) != sentence


def test_a_tenant_not_allowed_an_adapter_gets_404_and_does_not_see_it(
    up: Up,
) -> None:
    base, _, _ = up
    oai = client(base, KEY_B)
    assert {m.id for m in oai.models.list()} == {"smollm2", *NAMES, *PUBLISHED, *HOSTILE} - {
        NAMES[2]
    }
    with pytest.raises(openai.NotFoundError) as refused:
        ask(oai, NAMES[2], SENTENCES[2][0])
    assert refused.value.code == "model_not_found"
    assert ask(oai, NAMES[0], SENTENCES[0][0]) == SENTENCES[0][1]


def test_adapters_from_a_registry_and_an_archive_answer_as_their_folders_do(up: Up) -> None:
    base, _, _ = up
    oai = client(base, KEY_A)
    for name, (prompt, sentence) in zip(PUBLISHED, SENTENCES, strict=False):
        assert ask(oai, name, prompt) == sentence


def test_a_hostile_archive_is_refused_by_name_and_writes_nothing_outside(up: Up) -> None:
    """Attack by a namespace team (it may create LLMAdapters): an archive whose config is a
    link to a host file, and one that climbs out of the cache. Each request for them is a
    400 naming the member; nothing is written outside; the other adapters keep answering."""
    base, _, _ = up
    oai = client(base, KEY_A)
    for name, said in zip(HOSTILE, ("links and devices are refused", "outside"), strict=True):
        with pytest.raises(openai.BadRequestError) as refused:
            ask(oai, name, "Hello")
        assert refused.value.code == "adapter_load_failed", refused.value
        assert said in str(refused.value), refused.value
    assert not ESCAPE.exists() and not ESCAPE.parent.exists()
    assert ask(oai, NAMES[0], SENTENCES[0][0]) == SENTENCES[0][1]


def _engine_pids(parent: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError):
            continue
        if int(stat[1]) == parent and "servefleet engine" in cmd and stat[0] != "Z":
            found.append(int(entry.name))
    return sorted(found)


def test_an_engine_killed_while_an_adapter_loads_on_it_loses_no_request(
    up: Up,
) -> None:
    """One engine is frozen (SIGSTOP) and two requests for two adapters no replica holds go
    out at once: the least-loaded replica gets each, one apiece, so one load hangs on the
    frozen engine; it is then killed. Both requests must still get their adapter's sentence
    (the broken load moves its request to the other replica, which loads the adapter)."""
    base, parent, log = up
    engines = _engine_pids(parent)
    assert len(engines) == 2, engines
    victim = engines[0]
    asked = [(NAMES[i], *SENTENCES[i]) for i in (ROTATED, ROTATED + 1)]

    async def both() -> list[str]:
        oai = openai.AsyncOpenAI(base_url=base, api_key=KEY_A, max_retries=0, timeout=300)

        async def one(name: str, prompt: str) -> str:
            reply = await oai.chat.completions.create(
                model=name,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=MAX_TOKENS,
                temperature=0,
            )
            return reply.choices[0].message.content or ""

        tasks = [asyncio.create_task(one(name, prompt)) for name, prompt, _ in asked]
        await asyncio.sleep(2.0)  # both dispatched; the frozen engine holds one load
        os.kill(victim, signal.SIGKILL)
        return await asyncio.gather(*tasks)

    os.kill(victim, signal.SIGSTOP)
    try:
        answers = asyncio.run(both())
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)  # never leave a frozen engine behind
    assert answers == [sentence for _, _, sentence in asked]
    broken = [line for line in log if "adapter_load_failed" in line]
    assert broken, "no load was cut: the test did not test what it says"
    # The plane replaces the killed engine; the pool is whole again.
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        pids = _engine_pids(parent)
        if len(pids) == 2 and victim not in pids:
            ready = httpx.get(base.removesuffix("/v1") + "/ready", timeout=5)
            if ready.status_code == 200:
                break
        time.sleep(1)
    else:
        pytest.fail(f"the killed engine was not replaced: {_engine_pids(parent)}")
