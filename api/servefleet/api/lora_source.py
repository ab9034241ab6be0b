"""How an engine replica on Kubernetes finds an LLMAdapter's PEFT folder: its `lora_path`.

The gateway sends this string to `/v1/load_lora_adapter` (vLLM's body) when it loads an
adapter on a replica. Declaring an adapter never rolls the engine pods (it is a tenant
team's act; a rollout of the pool is the platform team's), so the files must be reachable
without a new volume or a new environment variable:

- huggingface and s3: our engine fetches `hf://<repo>@<revision>[?endpoint=<url>]` and
  `s3://<bucket>/<prefix>/[?endpoint=<url>&region=<r>]` itself, with the model fetcher (same
  cache layout, same progress lines), into its own cache (`remote_lora_path`,
  `parse_remote_lora_path`). vLLM and SGLang are sent the bare repository id, which they
  download from the Hub themselves (so: revision main, from the default endpoint or the
  `HF_ENDPOINT` their `engine.env` sets); they cannot read S3.
- pvc: a folder on the claim every engine pod already mounts at `/models` (the deployment's
  `model.source.pvc` or `model.cache.pvc`); any other claim would need a new volume.
- url (a .tar, .tar.gz or .tgz archive of the folder) and oci (an ORAS artifact whose layers
  are the folder's files, or an image whose layers hold it at `oci.path`): our engine fetches
  the URL itself, or pulls `oci://<reference>[?path=<folder>]` from the registry's HTTP API
  (mounting an image volume per adapter would roll every pod), and unpacks either into its
  cache, capped by `lora.MAX_ADAPTER_FILES` and `MAX_ADAPTER_BYTES`, refusing links and
  paths that leave the folder. vLLM and SGLang load neither: refused for them.

No credentials: the engine pods hold none, and the operator reads no Secrets. A tenant
team that may create LLMAdapters in a namespace need not be allowed to read its Secrets
(the deployment's tenant keys, the engine key): had the operator or the engines resolved a
Secret an adapter names and sent it to the adapter's endpoint, naming one would hand it over.
"""

from __future__ import annotations

import posixpath
from urllib.parse import parse_qs, quote, unquote, urlencode

from pydantic import ValidationError

from servefleet.api.builtin_models import BUILTIN_MODELS
from servefleet.api.conventions import MODEL_MOUNT
from servefleet.api.engine_spec import EngineSpec
from servefleet.api.llmdeployment import ModelSpec
from servefleet.api.lora import ADAPTER_ARCHIVE, ADAPTER_CONFIG, ADAPTER_WEIGHTS
from servefleet.api.model_source import ModelSource

ADAPTER_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS)
"""What an adapter fetch downloads from a Hub repository (a PEFT folder holds little else)."""
REMOTE_SCHEMES = ("hf://", "s3://", "oci://", "http://", "https://")
HF_ENDPOINT_ENV = "HF_ENDPOINT"
_USE_INSTEAD = (
    "use a public huggingface repository, an s3 folder, or a folder on the deployment's model PVC"
)


class AdapterSourceRefused(ValueError):
    """An adapter source the engines of a deployment cannot load; `reason` is CamelCase."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def kube_lora_path(source: ModelSource, model: ModelSpec, engine: EngineSpec) -> str:
    """The `lora_path` the engine pods (`engine`, serving `model`) load `source` from;
    AdapterSourceRefused, naming the field, when they cannot."""
    engine_kind = engine.kind
    _refuse_credentials(source)
    if source.pvc is not None:
        claims = mounted_claims(model)
        if source.pvc.claim_name not in claims:
            mounted = ", ".join(sorted(claims)) or "none"
            raise AdapterSourceRefused(
                "SourceNotMounted",
                f"source.pvc.claimName {source.pvc.claim_name} is not mounted in the engine "
                f"pods (they mount the deployment's model PVC only: {mounted}); "
                f"{_USE_INSTEAD}",
            )
        return posixpath.join(MODEL_MOUNT, source.pvc.path) if source.pvc.path else MODEL_MOUNT
    if source.huggingface is not None:
        hub = source.huggingface
        if hub.allow_patterns:
            raise AdapterSourceRefused(
                "SourceNotSupported",
                "source.huggingface.allowPatterns: an adapter is fetched as "
                f"{' and '.join(ADAPTER_FILES)}; leave it empty",
            )
        if engine_kind == "servefleet":
            return remote_lora_path(source)
        theirs = hub_endpoint(engine)
        ours = hub.endpoint.rstrip("/") if hub.endpoint else theirs
        if hub.revision != "main" or ours != theirs:
            raise AdapterSourceRefused(
                "SourceNotSupported",
                f"source.huggingface: engine.kind {engine_kind} downloads an adapter by its "
                f"repository id only (revision main, from {theirs or 'the default endpoint'}, "
                f"its engine.env {HF_ENDPOINT_ENV}); got {hub.repo}@{hub.revision}"
                + (f" at {hub.endpoint}" if hub.endpoint else ""),
            )
        return hub.repo
    if source.s3 is not None:
        if not source.s3.is_folder:
            raise AdapterSourceRefused(
                "SourceNotSupported",
                f"source.s3.url {source.s3.url}: an adapter is a folder: end the url in '/'",
            )
        if engine_kind != "servefleet":
            raise AdapterSourceRefused(
                "SourceNotSupported",
                f"source.s3: engine.kind {engine_kind} cannot load adapters from S3; "
                "use a huggingface repository or a folder on the deployment's model PVC",
            )
        return remote_lora_path(source)
    if source.url is not None or source.oci is not None:
        if engine_kind != "servefleet":
            raise AdapterSourceRefused(
                "SourceNotSupported",
                f"source.{source.kind}: engine.kind {engine_kind} cannot load adapters from "
                "it; use a huggingface repository or a folder on the deployment's model PVC",
            )
        if source.oci is not None and source.oci.pull_policy == "Always":
            raise AdapterSourceRefused(
                "SourceNotSupported",
                "source.oci.pullPolicy Always: an engine pulls an adapter once per reference "
                "and keeps it; publish a new tag or pin a digest to change it",
            )
        return remote_lora_path(source)
    raise AdapterSourceRefused(
        "SourceNotSupported",
        f"source.{source.kind}: engine pods would need a new volume for it (a rollout per "
        f"adapter); {_USE_INSTEAD}",
    )


def hub_endpoint(engine: EngineSpec) -> str | None:
    """The Hub mirror vLLM/SGLang pods download repository ids from (a literal
    HF_ENDPOINT in engine.env), None for the default."""
    found = [v.value for v in engine.env if v.name == HF_ENDPOINT_ENV and v.value]
    return found[-1].rstrip("/") if found else None


def mounted_claims(model: ModelSpec) -> set[str]:
    """The claims every engine pod mounts whole at MODEL_MOUNT (`operator.model_init`): the
    model's own PVC, or the PVC its downloads are cached on."""
    claims = {model.source.pvc.claim_name} if model.source.pvc is not None else set()
    if model.cache is not None and model.cache.pvc is not None:
        claims.add(model.cache.pvc.claim_name)
    return claims


def _refuse_credentials(source: ModelSource) -> None:
    hub, s3 = source.huggingface, source.s3
    field = (
        "source.huggingface.tokenSecretRef"
        if hub is not None and hub.token_secret_ref is not None
        else "source.s3.credentialsSecret"
        if s3 is not None and s3.credentials_secret is not None
        else None
    )
    if field is not None:
        raise AdapterSourceRefused(
            "CredentialsNotSupported",
            f"{field}: adapters are fetched by the engine pods, which hold no credentials, and "
            "the operator reads no Secrets on an adapter's behalf; use a public repository, an "
            "s3 folder the engine pods' own identity may read (credentialsSecret unset), or a "
            "folder on the deployment's model PVC",
        )


def remote_lora_path(source: ModelSource) -> str:
    """`hf://repo@revision` or `s3://bucket/prefix/`, with the endpoint (and region) as a query;
    `oci://reference[?path=folder]`; a url as it is. Credentials and allow-patterns are not
    part of it (see `kube_lora_path`)."""
    query: dict[str, str] = {}
    if source.url is not None:
        return source.url
    if source.oci is not None:
        query = {"path": source.oci.path} if source.oci.path else {}
        return f"oci://{source.oci.reference}" + (f"?{urlencode(query)}" if query else "")
    if source.huggingface is not None:
        hub = source.huggingface
        if hub.endpoint is not None:
            query["endpoint"] = hub.endpoint
        path = f"hf://{hub.repo}@{quote(hub.revision, safe='/')}"
    elif source.s3 is not None:
        s3 = source.s3
        query |= {k: v for k, v in (("endpoint", s3.endpoint), ("region", s3.region)) if v}
        path = f"s3://{s3.bucket}/{quote(s3.key, safe='/')}"
    else:
        raise ValueError(f"source.{source.kind} is not fetched by the engine")
    return path + (f"?{urlencode(query)}" if query else "")


def parse_remote_lora_path(path: str) -> ModelSource | None:
    """The source an `hf://`, `s3://`, `oci://` or http(s) lora path names (Hub fetches
    limited to ADAPTER_FILES); None for any other path (a folder on the engine's disk).
    ValueError when it is one of ours but malformed."""
    if not path.startswith(REMOTE_SCHEMES):
        return None
    scheme, rest = path.split("://", 1)
    if scheme in ("http", "https"):
        if not ADAPTER_ARCHIVE.match(path):
            raise ValueError(
                f"lora_path {path!r}: an adapter is a folder: name a .tar, .tar.gz or .tgz "
                "archive of it"
            )
        return _validated(path, {"url": path})
    body, _, text = rest.partition("?")
    parsed = parse_qs(text, keep_blank_values=True, strict_parsing=bool(text))
    if any(len(values) != 1 for values in parsed.values()):
        raise ValueError(f"lora_path {path!r}: each query parameter once")
    query = {k: v[0] for k, v in parsed.items()}
    allowed = {"hf": {"endpoint"}, "oci": {"path"}}.get(scheme, {"endpoint", "region"})
    if set(query) - allowed:
        raise ValueError(f"lora_path {path!r}: unknown parameters {sorted(set(query) - allowed)}")
    if scheme == "oci":
        return _validated(path, {"oci": {"reference": unquote(body), **query}})
    if scheme == "hf":
        repo, at, revision = body.partition("@")
        spec: dict[str, object] = {
            "repo": repo,
            "revision": unquote(revision) if at else "main",
            "allowPatterns": list(ADAPTER_FILES),
            **query,
        }
        return _validated(path, {"huggingface": spec})
    source = _validated(path, {"s3": {"url": f"s3://{unquote(body)}", **query}})
    assert source.s3 is not None
    if not source.s3.is_folder:
        raise ValueError(f"lora_path {path!r}: an adapter is a folder: end it in '/'")
    return source


def _validated(path: str, spec: dict[str, object]) -> ModelSource:
    try:
        return ModelSource.model_validate(spec)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ValueError(f"lora_path {path!r}: {where}: {first['msg']}") from None


def model_names(model_name: str, source: ModelSource) -> set[str]:
    """What a deployment's model is known as, for `lora.base_model_problem`: its served name
    and the ids of its source (a Hub repository, the folder or file it is read from, and a
    built-in's own name and its file's model name)."""
    names = {model_name}
    if source.builtin is not None:
        names.add(source.builtin)
        names.add(posixpath.basename(BUILTIN_MODELS[source.builtin].file).split(".")[0])
    if source.huggingface is not None:
        names.add(source.huggingface.repo)
    if source.s3 is not None and source.s3.key:
        names.add(source.s3.key.rstrip("/"))
    if source.pvc is not None and source.pvc.path:
        names.add(source.pvc.path)
    if source.oci is not None:
        names.add(source.oci.path or _image_repository(source.oci.reference))
    if source.url is not None:
        names.add(posixpath.basename(source.url.split("?", 1)[0]).split(".")[0])
    return {n for n in names if n}


def _image_repository(reference: str) -> str:
    """'registry:5000/models/llama:3.1@sha256:..' -> 'registry:5000/models/llama'."""
    name = reference.split("@", 1)[0]
    head, _, last = name.rpartition("/")
    return f"{head}/{last.split(':', 1)[0]}" if head else last.split(":", 1)[0]
