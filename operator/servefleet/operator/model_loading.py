"""The `ModelLoading` condition: how far the engine pods' model downloads are.

Pure, like `status`: the engine pods and the last lines of their fetch init containers'
logs in, (status, reason, message) out. The log is the channel on purpose: the init
container already prints progress for people, so the operator reads the same lines
(`pods/log`) and engine pods need no Kubernetes API access to report anything.

True while a download runs (`Downloading`, bytes done/total) or a pod waits to start one
(`Pending`); False once every pod has the model on disk (`Downloaded`), when there are no
pods (`NoReplicas`), or when a download failed (`DownloadFailed`, with the cause: not
found, access denied, a missing Secret). The fetcher keeps retrying a failed download in
the same container, so a bad token shows up here instead of as a crash loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from servefleet.api.fetch_progress import FETCH_CONTAINER, FetchProgress, last_report

STARTING = frozenset({"PodInitializing", "ContainerCreating"})
LOG_TAIL_LINES = 20

ModelLoading = tuple[bool, str, str]
"""(condition status, reason, message)."""


@dataclass(frozen=True)
class PodFetch:
    """Where one pod's download stands."""

    pod: str
    state: Literal["pending", "running", "done", "failed"]
    report: FetchProgress | None = None
    cause: str = ""


def _fetch_status(pod: dict[str, Any]) -> dict[str, Any]:
    for status in pod.get("status", {}).get("initContainerStatuses") or []:
        if status.get("name") == FETCH_CONTAINER:
            return dict(status)
    return {}


def fetching_pods(pods: list[dict[str, Any]]) -> list[str]:
    """Pods whose fetch container runs now: the ones whose log is worth reading."""
    return [
        p["metadata"]["name"]
        for p in pods
        if "running" in (_fetch_status(p).get("state") or {})
        and not p["metadata"].get("deletionTimestamp")
    ]


def pod_fetch(pod: dict[str, Any], log: str | None) -> PodFetch:
    """One pod's download from its init container status and (when running) its log."""
    name = pod["metadata"]["name"]
    status = _fetch_status(pod)
    state = status.get("state") or {}
    if "running" in state:
        report = last_report(log or "")
        if report is not None and report.state == "failed":
            return PodFetch(name, "failed", report, report.message)
        return PodFetch(name, "running", report)
    if "terminated" in state:
        ended = state["terminated"]
        if ended.get("exitCode") == 0:
            return PodFetch(name, "done")
        return PodFetch(name, "failed", cause=_ended_cause(ended))
    waiting = state.get("waiting")
    if not waiting or waiting.get("reason") in STARTING:
        return PodFetch(name, "pending")
    if waiting.get("reason") == "CrashLoopBackOff":
        return PodFetch(
            name, "failed", cause=_ended_cause(status.get("lastState", {}).get("terminated", {}))
        )
    cause = f"{waiting.get('reason', 'Waiting')}: {waiting.get('message', '')}".rstrip(": ")
    return PodFetch(name, "failed", cause=cause)


def _ended_cause(ended: dict[str, Any]) -> str:
    text = str(ended.get("message") or "")
    report = last_report(text)
    if report is not None and report.state == "failed":
        return report.message
    return text.strip().splitlines()[-1] if text.strip() else f"exit code {ended.get('exitCode')}"


def model_loading(pods: list[dict[str, Any]], logs: dict[str, str]) -> ModelLoading:
    """The condition for a downloaded source, from the engine pods and their fetch logs."""
    live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    fetches = [pod_fetch(p, logs.get(p["metadata"]["name"])) for p in live]
    if failed := [f for f in fetches if f.state == "failed"]:
        more = f" (and {len(failed) - 1} more pods)" if len(failed) > 1 else ""
        return False, "DownloadFailed", f"pod {failed[0].pod}: {failed[0].cause}{more}"
    if running := [f for f in fetches if f.state == "running"]:
        reports = [f.report for f in running if f.report is not None]
        if not reports:
            return True, "Downloading", f"{len(running)} pod(s) starting the download"
        best = max(reports, key=lambda r: r.done_bytes)
        total = "?" if best.total_bytes is None else str(best.total_bytes)
        message = f"{best.summary()}, {best.done_bytes}/{total} bytes, on {len(running)} pod(s)"
        return True, "Downloading", message
    if any(f.state == "pending" for f in fetches):
        return True, "Pending", "waiting for engine pods to start the download"
    if not fetches:
        return False, "NoReplicas", "no engine pods"
    return False, "Downloaded", f"model on disk on {len(fetches)} pod(s)"
