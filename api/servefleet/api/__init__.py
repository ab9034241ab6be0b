"""The LLMDeployment API shared by every servefleet component."""

from servefleet.api.llmdeployment import *  # noqa: F403
from servefleet.api.llmdeployment import __all__ as _model_names
from servefleet.api.manifests import (
    ManifestError,
    load_llmdeployments,
    load_secrets,
    parse_llmdeployment,
    resolve_secret,
    secret_env_name,
)

__all__ = [
    *_model_names,
    "ManifestError",
    "load_llmdeployments",
    "load_secrets",
    "parse_llmdeployment",
    "resolve_secret",
    "secret_env_name",
]
