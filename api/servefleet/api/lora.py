"""LoRA adapters: what a PEFT `adapter_config.json` may say, and the load/unload wire shapes.

One definition for every component that reads an adapter: the engine checks it when it loads
one, the operator when an adapter is declared (so a rank or target module the engine cannot
serve is refused at apply time, not at the first request). The load and unload bodies are
vLLM's (`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`), so one control path drives our
engine and vLLM alike.
"""

from __future__ import annotations

import math
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
MAX_ADAPTER_CONFIG_BYTES = 1 << 20
"""An `adapter_config.json` is a few hundred bytes; anything past this is not one."""
ADAPTER_ARCHIVE = re.compile(r"^[^?#]*[.](tar|tar[.]gz|tgz)([?#].*)?$")
"""A URL source of an adapter names a tar archive of its PEFT folder (a single file is no
folder): `.tar`, `.tar.gz` or `.tgz`, before any query."""
MAX_ADAPTER_FILES = 256
MAX_ADAPTER_BYTES = 8 << 30
"""Caps on what one adapter archive or OCI artifact may unpack to (a PEFT folder is two
files of megabytes): past them the fetch is refused, so a crafted archive cannot fill a
pod's disk."""

LoraTarget = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_TARGETS: tuple[LoraTarget, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)
"""The projections an adapter may adapt (PEFT's names for Llama-family layers)."""

ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")
"""What an adapter's name may be: it is a model name clients send and a metric label."""


class LoraConfigError(ValueError):
    """An adapter this engine cannot serve; the message names the field and the limit."""


class PeftLoraConfig(BaseModel):
    """The fields of PEFT's `LoraConfig` that decide what an adapter computes.

    Unknown fields are ignored (PEFT adds some every release); the ones that would change the
    computation in a way we do not implement are refused by name in `check_servable`.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    peft_type: str = "LORA"
    r: int = Field(gt=0)
    lora_alpha: float = Field(gt=0)
    target_modules: tuple[str, ...]
    base_model_name_or_path: str | None = None
    use_rslora: bool = False
    use_dora: bool = False
    bias: str = "none"
    fan_in_fan_out: bool = False
    modules_to_save: tuple[str, ...] | None = None
    rank_pattern: dict[str, int] = Field(default_factory=dict)
    alpha_pattern: dict[str, float] = Field(default_factory=dict)
    layers_to_transform: tuple[int, ...] | int | None = None

    @field_validator("target_modules", mode="before")
    @classmethod
    def _one_or_many(cls, value: object) -> object:
        """PEFT writes a list, or a single regex string; we take only plain module names."""
        if isinstance(value, str):
            raise ValueError("a regex is not supported: list the module names")
        return value

    @property
    def scaling(self) -> float:
        """What PEFT multiplies B·A·x by: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    def check_servable(self, max_rank: int) -> None:
        """Refuse, naming the field, what the engine would compute differently from PEFT."""
        if self.peft_type.upper() != "LORA":
            raise LoraConfigError(f"peft_type {self.peft_type!r}: only LORA adapters are served")
        if self.r > max_rank:
            raise LoraConfigError(f"r {self.r} is above the engine's --max-lora-rank {max_rank}")
        unknown = sorted(set(self.target_modules) - set(LORA_TARGETS))
        if unknown:
            raise LoraConfigError(
                f"target_modules {unknown} are not served (only {', '.join(LORA_TARGETS)})"
            )
        if not self.target_modules:
            raise LoraConfigError("target_modules is empty")
        refused = {
            "use_dora": self.use_dora,
            "fan_in_fan_out": self.fan_in_fan_out,
            "bias": self.bias != "none",
            "modules_to_save": bool(self.modules_to_save),
            "rank_pattern": bool(self.rank_pattern),
            "alpha_pattern": bool(self.alpha_pattern),
            "layers_to_transform": self.layers_to_transform is not None,
        }
        named = [field for field, used in refused.items() if used]
        if named:
            raise LoraConfigError(f"{', '.join(named)}: not supported by the engine")


class LoadLoraAdapterRequest(BaseModel):
    """vLLM's `/v1/load_lora_adapter` body: a name clients will send as `model`, and a
    directory on the engine's filesystem holding the PEFT files."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(pattern=ADAPTER_NAME.pattern)
    lora_path: str = Field(min_length=1, max_length=4096)
    load_inplace: bool = False


class UnloadLoraAdapterRequest(BaseModel):
    """vLLM's `/v1/unload_lora_adapter` body."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(pattern=ADAPTER_NAME.pattern)
    lora_int_id: int | None = None


# The engine's adapter metrics (the gateway's routing and the dashboards read them too).
LORA_ADAPTERS_LOADED_METRIC = "servefleet_engine_lora_adapters_loaded"
LORA_LOADS_METRIC = "servefleet_engine_lora_loads"
LORA_EVICTIONS_METRIC = "servefleet_engine_lora_evictions"
LORA_LOAD_SECONDS_METRIC = "servefleet_engine_lora_load_seconds"
LORA_REQUESTS_METRIC = "servefleet_engine_lora_requests"
LORA_TOKENS_METRIC = "servefleet_engine_lora_generation_tokens"
LORA_ADAPTER_LABEL = "adapter"


def base_model_problem(adapter_base: str | None, deployment_names: set[str]) -> str | None:
    """Why an adapter trained on `adapter_base` does not fit a deployment known by
    `deployment_names` (its model name and source ids), or None.

    Compared without case and on the last path segment as well, so a Hub id
    ('HuggingFaceTB/SmolLM2-135M-Instruct') matches the same model fetched to a folder; an
    adapter whose config names no base cannot be checked and is accepted.
    """
    if not adapter_base:
        return None

    def forms(name: str) -> set[str]:
        name = name.strip().rstrip("/").lower()
        return {name, name.rsplit("/", 1)[-1]}

    ours = set().union(*(forms(n) for n in deployment_names if n))
    if forms(adapter_base) & ours:
        return None
    return (
        f"the adapter was trained on {adapter_base!r}, but the deployment serves "
        f"{' / '.join(sorted(n for n in deployment_names if n))}"
    )
