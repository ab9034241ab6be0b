"""LLMAdapters in local mode: `servefleet up` checks each one at start (one line naming it,
exit status 2) and serves the rest through the same gateway config as Kubernetes; pvc
sources (adapters and models) are folders of this machine named by `--volume CLAIM=DIR`.

The adapter folders are tiny: an `adapter_config.json` as PEFT writes it (the fields of
`peft.LoraConfig(...).save_pretrained` in peft 0.21, unknown ones included) and a weights
file; the checks read no weights (the engine does, when the gateway loads the adapter).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from servefleet.api.manifests import load_llmadapters, load_llmdeployments
from servefleet.cli.main import main
from servefleet.local.adapters import check_local_adapters
from servefleet.local.engine_command import LocalModeError, engine_command
from servefleet.local.plane import LocalControlPlane, LocalOptions, banner
from servefleet.local.tenants import resolve_local_tenants

PEFT_CONFIG: dict[str, Any] = {
    "alpha_pattern": {},
    "auto_mapping": None,
    "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "bias": "none",
    "eva_config": None,
    "exclude_modules": None,
    "fan_in_fan_out": False,
    "inference_mode": True,
    "init_lora_weights": True,
    "layers_pattern": None,
    "layers_to_transform": None,
    "loftq_config": {},
    "lora_alpha": 16,
    "lora_bias": False,
    "lora_dropout": 0.0,
    "megatron_config": None,
    "modules_to_save": None,
    "peft_type": "LORA",
    "peft_version": "0.21.2",
    "r": 8,
    "rank_pattern": {},
    "revision": None,
    "target_modules": ["q_proj", "v_proj"],
    "task_type": "CAUSAL_LM",
    "use_dora": False,
    "use_rslora": False,
}

DEPLOYMENT = """
apiVersion: v1
kind: Secret
metadata: {name: keys}
stringData: {a: sk-team-a-key, b: sk-team-b-key}
---
apiVersion: servefleet.io/v1alpha1
kind: LLMDeployment
metadata: {name: smol}
spec:
  model: {name: smollm2, source: {builtin: smollm2-135m-instruct}}
  engine: {lora: {maxLoras: 2, maxLoraRank: 16}}
  tenants:
  - {name: team-a, apiKeySecretRef: {name: keys, key: a}}
  - {name: team-b, apiKeySecretRef: {name: keys, key: b}}
"""


def adapter_doc(name: str, **spec: Any) -> str:
    body = {"deployment": "smol", "source": {"pvc": {"claimName": "adapters", "path": name}}}
    body |= spec
    doc = {
        "apiVersion": "servefleet.io/v1alpha1",
        "kind": "LLMAdapter",
        "metadata": {"name": name},
        "spec": body,
    }
    return json.dumps(doc)  # JSON is YAML


def make_folder(root: Path, name: str, **config: Any) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps(PEFT_CONFIG | config))
    (folder / "adapter_model.safetensors").write_bytes(b"weights are not read here")
    return folder


@pytest.fixture
def volume(tmp_path: Path) -> Path:
    root = tmp_path / "claim"
    root.mkdir()
    return root


def manifest(tmp_path: Path, *docs: str, deployment: str = DEPLOYMENT) -> Path:
    path = tmp_path / "llmd.yaml"
    path.write_text("\n---\n".join([deployment, *docs]))
    return path


def check(path: Path, volume: Path) -> None:
    deployments = resolve_local_tenants(load_llmdeployments(path), path).deployments
    check_local_adapters(load_llmadapters(path), deployments, {"adapters": str(volume)})


def refused(path: Path, volume: Path) -> str:
    with pytest.raises(LocalModeError) as error:
        check(path, volume)
    message = str(error.value)
    assert "\n" not in message
    return message


def test_a_good_adapter_passes_and_is_served_from_its_folder(tmp_path: Path, volume: Path) -> None:
    fox = make_folder(volume, "fox")
    make_folder(volume, "teams/b/owl")
    path = manifest(
        tmp_path,
        adapter_doc("fox", tenants=["team-a"]),
        adapter_doc(
            "owl",
            model="team-b/owl",
            source={"pvc": {"claimName": "adapters", "path": "teams/b/owl"}},
        ),
    )
    check(path, volume)
    tenants = resolve_local_tenants(load_llmdeployments(path), path)
    options = LocalOptions(log_dir=tmp_path / "logs", volumes={"adapters": str(volume)})
    plane = LocalControlPlane(tenants.deployments, tenants, options, load_llmadapters(path))
    (dep,) = plane.gateway_config().deployments
    assert [(a.name, a.path, a.tenants) for a in dep.adapters] == [
        ("fox", str(fox), ["team-a"]),
        ("team-b/owl", str(volume / "teams/b/owl"), None),
    ]
    assert "adapters (loaded on demand): fox, team-b/owl" in banner(plane)


def test_the_deployment_must_be_in_the_file_in_the_same_namespace(
    tmp_path: Path, volume: Path
) -> None:
    make_folder(volume, "fox")
    message = refused(manifest(tmp_path, adapter_doc("fox", deployment="other")), volume)
    assert message.startswith("LLMAdapter fox: deployment other is not in the file")
    doc = json.loads(adapter_doc("fox"))
    doc["metadata"]["namespace"] = "team"
    assert "namespace team" in refused(manifest(tmp_path, json.dumps(doc)), volume)


def test_the_deployment_must_set_engine_lora(tmp_path: Path, volume: Path) -> None:
    make_folder(volume, "fox")
    plain = DEPLOYMENT.replace("  engine: {lora: {maxLoras: 2, maxLoraRank: 16}}\n", "")
    message = refused(manifest(tmp_path, adapter_doc("fox"), deployment=plain), volume)
    assert "LLMAdapter fox: deployment smol does not set engine.lora" in message


def test_remote_sources_are_fetched_by_the_engine_as_on_kubernetes(
    tmp_path: Path, volume: Path
) -> None:
    """The same YAML runs in both modes: a hub, s3, oci or url adapter is the lora_path the
    engine fetches itself; what no engine could fetch is refused at start, in one line."""
    remote = [
        adapter_doc("hub", source={"huggingface": {"repo": "team/fox"}}),
        adapter_doc("bucket", source={"s3": {"url": "s3://team/fox/"}}),
        adapter_doc("image", source={"oci": {"reference": "reg.test/fox:1", "path": "m"}}),
        adapter_doc("archive", source={"url": "https://files.test/fox.tgz"}),
    ]
    path = manifest(tmp_path, *remote)
    check(path, volume)
    tenants = resolve_local_tenants(load_llmdeployments(path), path)
    options = LocalOptions(log_dir=tmp_path / "logs", volumes={"adapters": str(volume)})
    plane = LocalControlPlane(tenants.deployments, tenants, options, load_llmadapters(path))
    (dep,) = plane.gateway_config().deployments
    assert [a.path for a in dep.adapters] == [
        "hf://team/fox@main",
        "s3://team/fox/",
        "oci://reg.test/fox:1?path=m",
        "https://files.test/fox.tgz",
    ]
    private = adapter_doc("p", source={"s3": {"url": "s3://team/p/", "credentialsSecret": "aws"}})
    message = refused(manifest(tmp_path, private), volume)
    assert message.startswith("LLMAdapter p: source.s3.credentialsSecret: adapters are fetched")


def test_only_pvc_folders_of_mapped_claims_are_read(tmp_path: Path, volume: Path) -> None:
    other_claim = adapter_doc("fox", source={"pvc": {"claimName": "elsewhere", "path": "fox"}})
    message = refused(manifest(tmp_path, other_claim), volume)
    assert "LLMAdapter fox: source.pvc: claim elsewhere is not a folder of this machine" in message
    assert "--volume elsewhere=DIR" in message


@pytest.mark.parametrize(
    ("setup", "expected"),
    [
        (lambda root: None, "is not a folder"),
        (lambda root: (root / "fox").mkdir(), "has no adapter_model.safetensors"),
        (
            lambda root: make_folder(root, "fox").joinpath("adapter_config.json").unlink(),
            "cannot read",
        ),
        (
            lambda root: make_folder(root, "fox").joinpath("adapter_config.json").write_text("{"),
            "is not JSON",
        ),
        (
            lambda root: make_folder(root, "fox").joinpath("adapter_config.json").write_text("{}"),
            "adapter_config.json: r: Field required",
        ),
    ],
    ids=["no-folder", "no-weights", "no-config", "not-json", "no-rank"],
)
def test_the_folder_must_hold_a_peft_adapter(
    tmp_path: Path, volume: Path, setup: Any, expected: str
) -> None:
    setup(volume)
    message = refused(manifest(tmp_path, adapter_doc("fox")), volume)
    assert message.startswith("LLMAdapter fox: ") and expected in message


def test_a_huge_config_is_not_read(tmp_path: Path, volume: Path) -> None:
    folder = make_folder(volume, "fox")
    (folder / "adapter_config.json").write_bytes(b" " * ((1 << 20) + 1))
    assert "over 1048576 bytes" in refused(manifest(tmp_path, adapter_doc("fox")), volume)


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"r": 32}, "r 32 is above the engine's --max-lora-rank 16"),
        ({"target_modules": ["q_proj", "lm_head"]}, "target_modules ['lm_head'] are not served"),
        ({"use_dora": True}, "use_dora: not supported by the engine"),
        ({"peft_type": "IA3"}, "peft_type 'IA3': only LORA adapters are served"),
    ],
)
def test_what_the_engine_cannot_serve_is_refused_at_start(
    tmp_path: Path, volume: Path, config: dict[str, Any], expected: str
) -> None:
    make_folder(volume, "fox", **config)
    message = refused(manifest(tmp_path, adapter_doc("fox")), volume)
    assert message.startswith(f"LLMAdapter fox: {expected}")


def test_an_adapter_of_another_base_model_names_both(tmp_path: Path, volume: Path) -> None:
    make_folder(volume, "fox", base_model_name_or_path="Qwen/Qwen2.5-7B-Instruct")
    message = refused(manifest(tmp_path, adapter_doc("fox")), volume)
    assert "LLMAdapter fox: the adapter was trained on 'Qwen/Qwen2.5-7B-Instruct'" in message
    assert "smollm2-135m-instruct" in message


@pytest.mark.parametrize(
    "base", ["smollm2-135m-instruct", "HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2", None]
)
def test_the_base_model_may_be_named_as_the_deployment_knows_it(
    tmp_path: Path, volume: Path, base: str | None
) -> None:
    make_folder(volume, "fox", base_model_name_or_path=base)
    check(manifest(tmp_path, adapter_doc("fox")), volume)


def test_tenants_must_be_tenants_of_the_deployment(tmp_path: Path, volume: Path) -> None:
    make_folder(volume, "fox")
    message = refused(manifest(tmp_path, adapter_doc("fox", tenants=["team-a", "team-z"])), volume)
    assert message == "LLMAdapter fox: tenants team-z are not tenants of deployment smol"


def test_an_adapter_may_not_take_the_base_models_name_or_another_adapters(
    tmp_path: Path, volume: Path
) -> None:
    make_folder(volume, "fox")
    message = refused(manifest(tmp_path, adapter_doc("fox", model="smollm2")), volume)
    assert "model name smollm2 is deployment smol's base model" in message
    twin = adapter_doc("owl", model="fox", source={"pvc": {"claimName": "adapters", "path": "fox"}})
    message = refused(manifest(tmp_path, adapter_doc("fox"), twin), volume)
    assert message.startswith("LLMAdapter owl: model name fox is served by LLMAdapter fox")


def test_up_refuses_a_bad_adapter_in_one_line_before_it_starts(
    tmp_path: Path, volume: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make_folder(volume, "fox", r=64)
    path = manifest(tmp_path, adapter_doc("fox"))
    assert main(["up", str(path), "--volume", f"adapters={volume}", "--port", "0"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "LLMAdapter fox: r 64 is above" in lines[0]
    # Without the claim mapped, the line says which flag is missing.
    assert main(["up", str(path), "--port", "0"]) == 2
    assert "--volume adapters=DIR" in capsys.readouterr().err


def test_up_refuses_a_volume_flag_that_is_not_a_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = manifest(tmp_path)
    for bad in ("adapters", "=x", f"adapters={tmp_path / 'absent'}"):
        with pytest.raises(SystemExit) as exit_info:
            main(["up", str(path), "--volume", bad])
        assert exit_info.value.code == 2
        assert "--volume" in capsys.readouterr().err


def test_a_model_on_a_pvc_is_read_from_its_mapped_claim(tmp_path: Path) -> None:
    """Local mode's pvc model: `pvc.path` is relative (the schema refuses anything else),
    inside the folder `--volume` maps the claim to."""
    doc = DEPLOYMENT.replace(
        "source: {builtin: smollm2-135m-instruct}",
        "source: {pvc: {claimName: models, path: qwen/instruct}}",
    )
    (dep,) = load_llmdeployments(manifest(tmp_path, deployment=doc))
    argv = engine_command(dep.spec, "127.0.0.1", 8123, volumes={"models": "/srv/models"})
    assert argv[argv.index("--model") + 1] == "/srv/models/qwen/instruct"
    with pytest.raises(LocalModeError, match=r"model\.source\.pvc: claim models .*--volume"):
        engine_command(dep.spec, "127.0.0.1", 8123)


def test_up_refuses_an_adapter_named_like_another_deployments_model(
    tmp_path: Path, volume: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The gateway config's own checks run before anything starts, as one line: a tenant
    asking for "other-model" could not tell the adapter from the other deployment."""
    make_folder(volume, "fox")
    other = DEPLOYMENT.split("---", 1)[1].replace("name: smol}", "name: big}")
    other = other.replace("model: {name: smollm2,", "model: {name: other-model,")
    path = manifest(tmp_path, other, adapter_doc("fox", model="other-model"))
    assert main(["up", str(path), "--volume", f"adapters={volume}", "--port", "0"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert "deployments smol and big: two deployments serve the same model name" in lines[0]
    assert "other-model to tenant team-a" in lines[0]
