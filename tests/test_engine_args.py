"""The same LLMDeployment runs the engine with the same flags locally and on Kubernetes.

Both command lines come from the adapter table in `servefleet.api.engines`; this renders a
few specs through local mode (`engine_command`) and through the operator (the engine
Deployment's container) and compares the engine arguments. Three values differ on purpose
and are normalised explicitly before comparing: where the engine listens (`--host`,
`--port`: a pod binds 0.0.0.0 on the adapter's port, a local replica a port of its own)
and where the weights are (`--model`: resolved per environment).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import pytest

from servefleet.api.engines import ENGINE_ADAPTERS
from servefleet.api.llmdeployment import LLMDeployment
from servefleet.api.quantity import parse_memory_size
from servefleet.cli import engine_cmd
from servefleet.engine.config import EngineConfig
from servefleet.local.engine_command import engine_command
from servefleet.operator import render

SETTINGS = render.RenderSettings(
    engine_image="servefleet:test",
    gateway_url="http://gw:8080",
    route_signing_key=b"route-signing-key-for-tests",
)
PER_ENVIRONMENT = ("--host", "--port", "--model")
LOCAL_HOST, LOCAL_PORT = "127.0.0.1", 8123

SPECS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "max-num-seqs": {"engine": {"maxNumSeqs": 4}, "pool": {"perReplicaConcurrency": 12}},
    "kv-cache-bytes": {"engine": {"kvCacheMemory": "4Gi"}},
    "kv-cache-fraction": {"engine": {"kvCacheMemory": "0.5"}},
    "no-prefix-caching": {"engine": {"prefixCaching": False, "maxNumBatchedTokens": 256}},
    "extra-args": {"engine": {"args": ["--max-model-len", "2048"], "dtype": "bfloat16"}},
    "speculative": {
        "engine": {
            "speculative": {"method": "ngram", "numSpeculativeTokens": 3, "minAcceptanceRate": 0.2}
        }
    },
    "lora": {"engine": {"lora": {"maxLoras": 3, "maxLoraRank": 24}}},
}


def deployment(extra: dict[str, Any]) -> LLMDeployment:
    spec = {"model": {"name": "tiny", "source": {"builtin": "smollm2-135m-instruct"}}, **extra}
    return LLMDeployment.model_validate(
        {"metadata": {"name": "m", "namespace": "ns", "uid": "u"}, "spec": spec}
    )


def normalised(args: list[str]) -> list[str]:
    """`args` with the value of each per-environment flag replaced by a placeholder."""
    out = list(args)
    for flag in PER_ENVIRONMENT:
        assert out.count(flag) == 1, f"{flag} once in {args}"
        out[out.index(flag) + 1] = "<per environment>"
    return out


def flag_value(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


@pytest.mark.parametrize("extra", SPECS.values(), ids=SPECS.keys())
def test_local_mode_and_the_operator_pass_the_same_engine_args(extra: dict[str, Any]) -> None:
    dep = deployment(extra)
    (container,) = render.engine_deployment(dep, SETTINGS)["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["servefleet", "engine"]
    pod_args: list[str] = container["args"]

    local = engine_command(dep.spec, LOCAL_HOST, LOCAL_PORT)
    engine_at = local.index("engine")  # after this installation's `servefleet` script
    local_args = local[engine_at + 1 :]

    assert normalised(local_args) == normalised(pod_args)
    # What was normalised away is what each environment decides, and nothing else.
    assert (flag_value(local_args, "--host"), flag_value(local_args, "--port")) == (
        LOCAL_HOST,
        str(LOCAL_PORT),
    )
    port = ENGINE_ADAPTERS["servefleet"].port
    assert (flag_value(pod_args, "--host"), flag_value(pod_args, "--port")) == (
        "0.0.0.0",
        str(port),
    )


def test_both_places_size_the_engine_from_per_replica_concurrency() -> None:
    """The drift this table ended: the pods once ran with the engine's defaults (64/256)."""
    dep = deployment({"pool": {"perReplicaConcurrency": 12}})
    pod_args = render.engine_deployment(dep, SETTINGS)["spec"]["template"]["spec"]["containers"][0][
        "args"
    ]
    local_args = engine_command(dep.spec, LOCAL_HOST, LOCAL_PORT)
    for args in (pod_args, local_args):
        assert flag_value(args, "--max-num-seqs") == "12"
        assert flag_value(args, "--max-queue-depth") == "12"
    explicit = deployment({"engine": {"maxNumSeqs": 4}, "pool": {"perReplicaConcurrency": 12}})
    assert flag_value(engine_command(explicit.spec, LOCAL_HOST, 1), "--max-num-seqs") == "4"


def test_kv_cache_memory_reaches_the_engine_in_one_spelling() -> None:
    dep = deployment({"engine": {"kvCacheMemory": "4Gi"}})
    assert flag_value(engine_command(dep.spec, LOCAL_HOST, 1), "--kv-cache-memory") == str(4 << 30)


@pytest.mark.parametrize("extra", SPECS.values(), ids=SPECS.keys())
def test_our_engine_reads_every_flag_the_adapter_writes(extra: dict[str, Any]) -> None:
    dep = deployment(extra)
    adapter = ENGINE_ADAPTERS["servefleet"]
    args = adapter.args(dep.spec, "smollm2-135m-instruct", adapter.pod_listen())
    parser = argparse.ArgumentParser()
    engine_cmd.add_arguments(parser)
    config = EngineConfig(**engine_cmd.engine_settings(parser.parse_args(args)))
    engine, concurrency = dep.spec.engine, dep.spec.pool.per_replica_concurrency
    assert config.max_num_seqs == (engine.max_num_seqs or concurrency)
    assert config.max_queue_depth == concurrency
    assert config.enable_prefix_caching == engine.prefix_caching
    if engine.kv_cache_memory is not None:
        assert parse_memory_size(config.kv_cache_memory) == engine.kv_cache_size()
    wanted = engine.speculative and engine.speculative.to_config()
    assert config.speculative_config == wanted
    assert config.enable_lora == (engine.lora is not None)
    if engine.lora is not None:
        assert (config.max_loras, config.max_lora_rank) == (3, 24)


def test_vllm_gets_the_same_speculative_json_without_our_keys() -> None:
    """vLLM refuses unknown keys, so our adaptive knob stays out of its object."""
    speculative = {"method": "ngram", "numSpeculativeTokens": 3, "promptLookupMax": 5}
    spec = {"model": {"name": "m", "source": {"url": "https://x/m"}}, "engine": {"kind": "vllm"}}
    spec["engine"]["speculative"] = speculative  # type: ignore[index]
    dep = LLMDeployment.model_validate({"metadata": {"name": "m", "namespace": "ns"}, "spec": spec})
    adapter = ENGINE_ADAPTERS["vllm"]
    args = adapter.args(dep.spec, "/models/m", adapter.pod_listen())
    assert json.loads(flag_value(args, "--speculative-config")) == {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_max": 5,
    }
    assert "--speculative-config" not in ENGINE_ADAPTERS["sglang"].args(
        deployment({}).spec, "/m", adapter.pod_listen()
    )
