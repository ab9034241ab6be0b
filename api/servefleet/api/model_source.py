"""Where a deployment's weights come from, and the cache that keeps downloads on disk.

Its own module because three rooms read it: the operator renders volumes and the fetch
init container from it, the fetch code downloads what it names, and both must agree on
the folder a download lands in (`ModelSource.fetched_path`), so that is defined here once.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
from typing import Annotated, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator
from pydantic.json_schema import JsonDict

from servefleet.api.api_model import DNS_SUBDOMAIN, ApiModel, SecretKeyRef, cel_rule
from servefleet.api.builtin_models import BuiltinModelName

SOURCE_FIELDS = ("builtin", "pvc", "url", "huggingface", "s3", "oci")
DOWNLOADED_SOURCES = ("url", "huggingface", "s3")
_ONE_OF = "model.source needs exactly one of builtin, pvc, url, huggingface, s3 or oci"
_CACHE_NEEDS_DOWNLOAD = "model.cache applies only to the url, huggingface and s3 sources"

# A path a pod mounts or reads must stay where it is put: no `..` segment may climb out of
# the volume, the image or the node folder. Checked twice, like every rule (a CEL rule on
# the field, so `kubectl apply` refuses it; a pydantic validator), with the same message.
_CLIMBS = "(^|/)[.][.](/|$)"
PATH_MAX_LENGTH = 500


def _climbs(path: str) -> bool:
    return ".." in path.split("/")


def relative_path_rule(field: str) -> JsonDict:
    """The CEL rule of a path relative to a volume's root."""
    return {
        "x-kubernetes-validations": [
            cel_rule(f"!self.startsWith('/') && !self.matches('{_CLIMBS}')", _relative(field))
        ]
    }


def _relative(field: str) -> str:
    return f"{field} must be a path inside its volume: relative, without '..' segments"


def _check_relative(value: str, field: str) -> str:
    if value.startswith("/") or _climbs(value):
        raise ValueError(_relative(field))
    return value


def _no_climbing(field: str) -> str:
    return f"{field} must not contain '..' segments"


def no_climbing_rule(field: str) -> JsonDict:
    """The CEL rule of a value that becomes a path somewhere (an object key, a revision)."""
    return {
        "x-kubernetes-validations": [cel_rule(f"!self.matches('{_CLIMBS}')", _no_climbing(field))]
    }


class PvcModelSource(ApiModel):
    """A Hugging Face model folder (config.json, tokenizer, safetensors) on a volume."""

    claim_name: str = Field(
        description="PersistentVolumeClaim holding the model folder; mounted read-only."
    )
    path: str = Field(
        default="",
        description="Folder of the model inside the volume, relative to its root ('' = the "
        "root); no '..' segments.",
        max_length=PATH_MAX_LENGTH,
        json_schema_extra=relative_path_rule("model.source.pvc.path"),
    )

    @field_validator("path")
    @classmethod
    def _inside(cls, value: str) -> str:
        return _check_relative(value, "model.source.pvc.path")


class HuggingFaceSource(ApiModel):
    """A model repository on the Hugging Face Hub (or a Hub-compatible mirror)."""

    repo: str = Field(
        description="Repository id, e.g. 'Qwen/Qwen2.5-7B-Instruct'.",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$",
        max_length=200,
    )
    revision: str = Field(
        default="main",
        description="Branch, tag or commit. A branch is cached under its name: pin a commit "
        "to be sure every replica serves the same weights.",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]*$",
        max_length=200,
        json_schema_extra=no_climbing_rule("model.source.huggingface.revision"),
    )
    token_secret_ref: SecretKeyRef | None = Field(
        default=None, description="Secret key holding a Hub token (gated or private repos)."
    )
    allow_patterns: list[Annotated[str, Field(min_length=1, max_length=200)]] = Field(
        default_factory=list,
        max_length=32,
        description="Glob patterns of the files to fetch (empty = every file), "
        "e.g. ['*.json', '*.safetensors', 'tokenizer*'].",
    )
    endpoint: str | None = Field(
        default=None,
        description="Base URL of a Hub mirror (default: https://huggingface.co).",
        pattern=r"^https?://.+",
        max_length=500,
    )

    @field_validator("revision")
    @classmethod
    def _revision(cls, value: str) -> str:
        if _climbs(value):
            raise ValueError(_no_climbing("model.source.huggingface.revision"))
        return value


class S3Source(ApiModel):
    """An object or a folder (prefix) in an S3-compatible bucket (AWS, MinIO, Ceph, GCS)."""

    url: str = Field(
        description="s3://bucket/key for one file (e.g. a GGUF), s3://bucket/prefix/ (ending "
        "in '/') for a model folder.",
        pattern=r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?$",
        max_length=1000,
        json_schema_extra=no_climbing_rule("model.source.s3.url"),
    )
    endpoint: str | None = Field(
        default=None,
        description="Endpoint URL of an S3-compatible service (default: AWS).",
        pattern=r"^https?://.+",
        max_length=500,
    )
    region: str | None = Field(
        default=None, description="Region of the bucket.", max_length=64, pattern=r"^[a-z0-9-]+$"
    )
    credentials_secret: str | None = Field(
        default=None,
        description="Secret with the keys AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and "
        "optionally AWS_SESSION_TOKEN); unset = the pod's own identity (IRSA, instance role).",
        pattern=DNS_SUBDOMAIN,
        max_length=253,
    )

    @field_validator("url")
    @classmethod
    def _key(cls, value: str) -> str:
        if _climbs(value):
            raise ValueError(_no_climbing("model.source.s3.url"))
        return value

    @property
    def bucket(self) -> str:
        return self.url.removeprefix("s3://").split("/", 1)[0]

    @property
    def key(self) -> str:
        """The object key, or the prefix when it ends in '/' (or is empty: the whole bucket)."""
        parts = self.url.removeprefix("s3://").split("/", 1)
        return parts[1] if len(parts) > 1 else ""

    @property
    def is_folder(self) -> bool:
        return self.key == "" or self.key.endswith("/")


class OciImageSource(ApiModel):
    """Weights packaged in an OCI image, mounted as a Kubernetes `image` volume (needs a
    cluster with the ImageVolume feature); nothing is copied, the node's image store caches it."""

    reference: str = Field(
        description="Image reference, e.g. 'registry.example.com/models/llama:3.1-8b'.",
        min_length=1,
        max_length=500,
    )
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent", description="When the kubelet pulls the image."
    )
    path: str = Field(
        default="",
        description="Model folder or file inside the image, relative to its root ('' = root); "
        "no '..' segments.",
        max_length=PATH_MAX_LENGTH,
        json_schema_extra=relative_path_rule("model.source.oci.path"),
    )

    @field_validator("path")
    @classmethod
    def _inside(cls, value: str) -> str:
        return _check_relative(value, "model.source.oci.path")


class ModelSource(ApiModel):
    """Where the weights come from; exactly one source."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel_rule(
                    "[" + ", ".join(f"has(self.{f})" for f in SOURCE_FIELDS) + "].exists_one(x, x)",
                    _ONE_OF,
                )
            ]
        }
    )

    builtin: BuiltinModelName | None = Field(
        default=None,
        description="A model shipped with the servefleet image, e.g. 'smollm2-135m-instruct'.",
    )
    pvc: PvcModelSource | None = Field(
        default=None, description="A Hugging Face model folder on a PersistentVolumeClaim."
    )
    url: str | None = Field(
        default=None,
        description="http(s) URL of a weights file (e.g. GGUF), fetched before the engine starts.",
        pattern=r"^https?://.+",
        max_length=2000,
        json_schema_extra=no_climbing_rule("model.source.url"),
    )
    huggingface: HuggingFaceSource | None = Field(
        default=None, description="A Hugging Face Hub repository, fetched before the engine."
    )
    s3: S3Source | None = Field(
        default=None, description="An S3-compatible object or prefix, fetched before the engine."
    )
    oci: OciImageSource | None = Field(
        default=None, description="An OCI image mounted as a volume (ImageVolume feature)."
    )

    @field_validator("url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is not None and _climbs(value):
            raise ValueError(_no_climbing("model.source.url"))
        return value

    @model_validator(mode="after")
    def _exactly_one(self) -> ModelSource:
        if sum(getattr(self, f) is not None for f in SOURCE_FIELDS) != 1:
            raise ValueError(_ONE_OF)
        return self

    @property
    def kind(self) -> str:
        """Which source is set: 'builtin', 'pvc', 'url', 'huggingface', 's3' or 'oci'."""
        return next(f for f in SOURCE_FIELDS if getattr(self, f) is not None)

    @property
    def downloads(self) -> bool:
        """Whether the weights are fetched into a cache before the engine starts."""
        return self.kind in DOWNLOADED_SOURCES

    def cache_entry(self) -> str:
        """The folder, relative to the cache root, a download of this source lands in.

        Readable (kind and name) for a person looking at the cache, plus a hash of what
        identifies the content (never credentials), so two sources never share a folder.
        """
        identity = self.model_dump(
            mode="json",
            exclude_none=True,
            exclude={"huggingface": {"token_secret_ref"}, "s3": {"credentials_secret"}},
        )
        digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]
        if self.huggingface is not None:
            readable = f"{self.huggingface.repo}-{self.huggingface.revision}"
        elif self.s3 is not None:
            readable = f"{self.s3.bucket}-{self.s3.key}"
        elif self.url is not None:
            readable = self.url.split("://", 1)[-1].split("?", 1)[0]
        elif self.oci is not None:  # an adapter the engine pulls (`api.lora_source`)
            readable = f"{self.oci.reference}-{self.oci.path}"
        else:
            raise ValueError(f"model.source.{self.kind} is not downloaded")
        slug = re.sub(r"[^A-Za-z0-9._-]+", "-", readable).strip("-.")[:80]
        return f"{self.kind}--{slug}--{digest}"

    def fetched_path(self) -> str:
        """What the engine loads, relative to the cache root: the folder, or the one file."""
        entry = self.cache_entry()
        if self.url is not None:
            return posixpath.join(entry, url_filename(self.url))
        if self.s3 is not None and not self.s3.is_folder:
            return posixpath.join(entry, posixpath.basename(self.s3.key))
        return entry


def url_filename(url: str) -> str:
    """The file name a URL download is saved under (its last path segment)."""
    return posixpath.basename(url.split("?", 1)[0].split("#", 1)[0]) or "model"


class PvcModelCache(ApiModel):
    """A PersistentVolumeClaim the deployment's pods share as their download cache."""

    claim_name: str = Field(
        description="PersistentVolumeClaim for the cache; ReadWriteMany when replicas may "
        "run on different nodes.",
        pattern=DNS_SUBDOMAIN,
        max_length=253,
    )


HOST_PATH_MESSAGE = "model.cache.hostPath.path must be an absolute folder without '..' segments"


class HostPathModelCache(ApiModel):
    """A folder on each node: replicas on the same node (and restarts) share it.

    Only under a folder the platform admin allows (the operator's --allowed-host-path-prefix;
    none by default): a deployment elsewhere is refused with a condition and an Event."""

    path: str = Field(
        description="Absolute folder on the node, under a prefix the platform admin allows "
        "(operator.allowedHostPathPrefixes; none by default); no '..' segments.",
        pattern=r"^/.+",
        max_length=PATH_MAX_LENGTH,
        json_schema_extra={
            "x-kubernetes-validations": [
                cel_rule(f"self.startsWith('/') && !self.matches('{_CLIMBS}')", HOST_PATH_MESSAGE)
            ]
        },
    )

    @field_validator("path")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if not value.startswith("/") or _climbs(value):
            raise ValueError(HOST_PATH_MESSAGE)
        return value


class ModelCache(ApiModel):
    """Where downloads are kept, so the second replica and every restart load from disk.

    Without one, each pod downloads into its own emptyDir."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel_rule(
                    "[has(self.pvc), has(self.hostPath)].exists_one(x, x)",
                    "model.cache needs exactly one of pvc or hostPath",
                )
            ]
        }
    )

    pvc: PvcModelCache | None = Field(
        default=None, description="A PersistentVolumeClaim shared by the pods."
    )
    host_path: HostPathModelCache | None = Field(
        default=None, description="A node-local folder (opt-in: it outlives the deployment)."
    )

    @model_validator(mode="after")
    def _exactly_one(self) -> ModelCache:
        if (self.pvc is None) == (self.host_path is None):
            raise ValueError("model.cache needs exactly one of pvc or hostPath")
        return self


def cache_rule() -> JsonDict:
    """The CEL rule on ModelSpec: a cache only for sources that download."""
    downloaded = " || ".join(f"has(self.source.{f})" for f in DOWNLOADED_SOURCES)
    return cel_rule(f"!has(self.cache) || {downloaded}", _CACHE_NEEDS_DOWNLOAD)


def check_cache(source: ModelSource, cache: ModelCache | None) -> None:
    """The pydantic half of `cache_rule`."""
    if cache is not None and not source.downloads:
        raise ValueError(_CACHE_NEEDS_DOWNLOAD)
