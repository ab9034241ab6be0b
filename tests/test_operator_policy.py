"""The admin's lists (engine images, node folders) the operator holds deployments to."""

from __future__ import annotations

import pytest

from servefleet.operator.policy import host_path_mount, image_allowed, image_repository


@pytest.mark.parametrize(
    ("image", "allowed", "expected"),
    [
        ("vllm/vllm-openai:v0.10.1.1", ["vllm/vllm-openai"], True),
        ("docker.io/vllm/vllm-openai:v0.10.1.1", ["vllm/vllm-openai"], True),
        ("vllm/vllm-openai:v0.10.1.1", ["docker.io/vllm/vllm-openai"], True),
        ("redis", ["docker.io/library/redis"], True),
        ("vllm/vllm-openai:v1", ["vllm/vllm-openai:v0.10.1.1"], False),  # exact entry
        ("vllm/vllm-openai:v0.10.1.1", ["vllm/vllm-openai:v0.10.1.1"], True),
        ("vllm/vllm-openai-evil:1", ["vllm/vllm-openai"], False),
        ("evil/vllm/vllm-openai:1", ["vllm/vllm-openai"], False),
        ("registry.example.com/models/x:1", ["registry.example.com/models/*"], True),
        ("registry.example.com/models-evil/x:1", ["registry.example.com/models/*"], False),
        ("registry.example.com:5000/x:1", ["registry.example.com:5000/x"], True),
        ("registry.example.com:5000/x:1", ["registry.example.com/x"], False),
        ("anything:1", [], False),
    ],
)
def test_image_allow_list_entries(image: str, allowed: list[str], expected: bool) -> None:
    assert image_allowed(image, allowed) is expected


def test_repositories_are_read_as_the_runtime_reads_them() -> None:
    assert image_repository("redis:7") == "docker.io/library/redis"
    assert image_repository("ghcr.io/a/b@sha256:00") == "ghcr.io/a/b"
    assert image_repository("localhost:5000/b:1") == "localhost:5000/b"


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/var/cache/servefleet", ("/var/cache/servefleet", "")),
        ("/var/cache/servefleet/", ("/var/cache/servefleet", "")),
        ("/var/cache/servefleet/team-a/x", ("/var/cache/servefleet", "team-a/x")),
        ("/var/cache/servefleet//team-a/./x", ("/var/cache/servefleet", "team-a/x")),
        ("/var/cache/servefleet-evil", None),
        ("/var/cache", None),
        ("/etc", None),
    ],
)
def test_host_paths_only_under_allowed_prefixes(
    path: str, expected: tuple[str, str] | None
) -> None:
    assert host_path_mount(path, ["/var/cache/servefleet/"]) == expected
    assert host_path_mount(path, []) is None
