"""Test helpers over the real binaries: kubectl, helm, and the operator as a process."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import yaml
from k8s.cluster import write_kubeconfig

T = TypeVar("T")


class CommandFailed(AssertionError):
    def __init__(self, args: list[str], returncode: int, output: str) -> None:
        super().__init__(f"{' '.join(args)} exited {returncode}:\n{output}")
        self.output = output


def wait_for(
    what: str,
    check: Callable[[], T | None],
    timeout: float = 60.0,
    interval: float = 0.3,
    describe: Callable[[], object] | None = None,
) -> T:
    """Poll until `check` returns something truthy; fail with `what` after `timeout`, and
    with what `describe` returns then (the state that never came right)."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = check()
            if value:
                return value
        except (CommandFailed, KeyError, IndexError, TypeError) as exc:
            last_error = exc
        time.sleep(interval)
    seen = f"; seen: {describe()}" if describe is not None else ""
    raise AssertionError(
        f"timed out after {timeout}s waiting for {what} (last error: {last_error}){seen}"
    )


@dataclass
class Kube:
    kubeconfig: Path
    kubectl_bin: Path
    helm_bin: Path

    def _run(
        self, binary: Path, args: tuple[str, ...], stdin: str | None, check: bool
    ) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig)}
        done = subprocess.run(
            [str(binary), *args],
            input=stdin,
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
            check=False,
        )
        if check and done.returncode != 0:
            raise CommandFailed([binary.name, *args], done.returncode, done.stdout + done.stderr)
        return done

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True) -> str:
        done = self._run(self.kubectl_bin, args, stdin, check)
        return done.stdout if done.returncode == 0 else done.stdout + done.stderr

    def kubectl_result(
        self, *args: str, stdin: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        return self._run(self.kubectl_bin, args, stdin, check=False)

    def helm(self, *args: str) -> str:
        return self._run(self.helm_bin, args, None, check=True).stdout

    def apply_text(self, text: str, namespace: str | None = None) -> str:
        ns = ["-n", namespace] if namespace else []
        return self.kubectl("apply", *ns, "-f", "-", stdin=text)

    def get(self, kind: str, name: str, namespace: str) -> dict[str, Any] | None:
        done = self.kubectl_result("get", kind, name, "-n", namespace, "-o", "json")
        if done.returncode != 0:
            if "NotFound" in done.stderr:
                return None
            raise CommandFailed(["kubectl", "get", kind, name], done.returncode, done.stderr)
        result: dict[str, Any] = json.loads(done.stdout)
        return result

    def list(self, kind: str, namespace: str, selector: str | None = None) -> list[dict[str, Any]]:
        args = ["get", kind, "-n", namespace, "-o", "json"]
        if selector:
            args += ["-l", selector]
        items: list[dict[str, Any]] = json.loads(self.kubectl(*args))["items"]
        return items

    def create_namespace(self, name: str) -> None:
        self.kubectl("create", "namespace", name)

    def secret_file(self, namespace: str, name: str, key: str, path: Path) -> Path:
        """One key of a Secret written to `path` (what a pod mounting it would read)."""
        encoded = self.kubectl(
            "get", "secret", name, "-n", namespace, "-o", f"jsonpath={{.data.{key}}}"
        )
        path.write_bytes(base64.b64decode(encoded))
        return path

    def service_account_kubeconfig(self, namespace: str, name: str, path: Path) -> Path:
        token = self.kubectl("create", "token", name, "-n", namespace, "--duration=4h").strip()
        server = yaml.safe_load(self.kubeconfig.read_text())["clusters"][0]["cluster"]["server"]
        return write_kubeconfig(path, server, token, namespace)

    def mark_pods_ready(self, namespace: str, selector: str, limit: int | None = None) -> int:
        """Stand in for the kubelet: set Running + Ready on pods that are not yet ready."""
        marked = 0
        for pod in self.list("pods", namespace, selector):
            if limit is not None and marked >= limit:
                break
            if pod["metadata"].get("deletionTimestamp") or is_ready(pod):
                continue
            now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            conditions = [
                {"type": t, "status": "True", "lastTransitionTime": now}
                for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")
            ]
            patch = {"status": {"phase": "Running", "conditions": conditions, "startTime": now}}
            done = self.kubectl_result(
                "patch",
                "pod",
                pod["metadata"]["name"],
                "-n",
                namespace,
                "--subresource=status",
                "--type=merge",
                "-p",
                json.dumps(patch),
            )
            if done.returncode == 0:
                marked += 1
        return marked


def is_ready(pod: dict[str, Any]) -> bool:
    conditions = pod.get("status", {}).get("conditions", []) or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def condition(obj: dict[str, Any] | None, type_: str) -> dict[str, Any] | None:
    for cond in (obj or {}).get("status", {}).get("conditions", []) or []:
        if cond.get("type") == type_:
            return dict(cond)
    return None


class OperatorProcess:
    """`servefleet operator` as a child process, with the chart ServiceAccount's kubeconfig."""

    def __init__(
        self,
        kubeconfig: Path,
        log_dir: Path,
        route_key_file: Path,
        resync_seconds: float = 3.0,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.kubeconfig = kubeconfig
        self.route_key_file = route_key_file
        self.extra_args = extra_args
        self.log_dir = log_dir
        self.resync_seconds = resync_seconds
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"operator-{self.starts}.log"

    def start(self) -> None:
        self.starts += 1
        code = "import importlib.util, sys; from servefleet.cli.main import main; sys.exit(main())"
        args = [
            sys.executable,
            "-c",
            code,
            "operator",
            f"--kubeconfig={self.kubeconfig}",
            "--engine-image=servefleet:e2e",
            "--gateway-url=http://servefleet-gateway.servefleet.svc:8080",
            f"--resync-seconds={self.resync_seconds}",
            "--health-port=0",
            "--log-level=INFO",
            f"--route-signing-key-file={self.route_key_file}",
            "--system-namespace=servefleet",
            *self.extra_args,
        ]
        env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
        log = open(self.log_path, "wb")  # noqa: SIM115 - closed with the process
        self.proc = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def stop(self, hard: bool = False) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGKILL if hard else signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=5)

    def restart(self, hard: bool = True) -> None:
        self.stop(hard=hard)
        self.start()

    def logs(self) -> str:
        return "\n".join(
            (self.log_dir / f"operator-{i}.log").read_text(errors="replace")
            for i in range(1, self.starts + 1)
        )

    def assert_alive(self) -> None:
        assert self.proc is not None and self.proc.poll() is None, (
            f"operator died:\n{self.logs()[-4000:]}"
        )
