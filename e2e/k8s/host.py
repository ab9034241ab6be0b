"""What the e2e node changes on the host, and how it is put back.

The node needs a bridge for its pods, and kubelet/kube-proxy/kube-router add iptables
chains, ipsets, cgroups and mounts; containerd leaves shims and mounts when it stops hard.
Each helper here undoes one of those and touches nothing of anyone else's (chains and ipsets
by prefix, mounts by directory, shims by their containerd socket).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
from pathlib import Path

KUBE_CHAIN_PREFIX = "KUBE-"
CGROUP_ROOT = Path("/sys/fs/cgroup")


def run(*args: str, check: bool = False) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, check=check, timeout=60)


def create_bridge(name: str, gateway_cidr: str) -> None:
    """The pod bridge, up and holding the node's address before anything listens on it."""
    if run("ip", "link", "show", name).returncode != 0:
        run("ip", "link", "add", name, "type", "bridge", check=True)
    if gateway_cidr.split("/")[0] not in run("ip", "-4", "addr", "show", name).stdout:
        run("ip", "addr", "add", gateway_cidr, "dev", name, check=True)
    run("ip", "link", "set", name, "up", check=True)


def delete_bridge(name: str) -> None:
    run("ip", "link", "delete", name)


def remove_iptables_chains(prefix: str = KUBE_CHAIN_PREFIX) -> None:
    """Unhook and delete every chain named `prefix*` (kubelet's and kube-proxy's)."""
    for binary in ("iptables", "ip6tables"):
        for table in ("filter", "nat", "mangle"):
            listed = run(binary, "-t", table, "-S")
            if listed.returncode != 0:
                continue
            rules = listed.stdout.splitlines()
            for rule in rules:
                words = shlex.split(rule)
                jumps_to_ours = any(w.startswith(prefix) for w in words[2:])
                if words[:1] == ["-A"] and not words[1].startswith(prefix) and jumps_to_ours:
                    run(binary, "-t", table, "-D", *words[1:])
            chains = [
                rule.split()[1]
                for rule in rules
                if rule.startswith("-N ") and rule.split()[1].startswith(prefix)
            ]
            for chain in chains:
                run(binary, "-t", table, "-F", chain)
            for chain in chains:
                run(binary, "-t", table, "-X", chain)


def destroy_ipsets(prefix: str = KUBE_CHAIN_PREFIX) -> None:
    """Destroy every ipset named `prefix*` (kube-router's policy sets; IPv6 ones `inet6:*`).

    Call after `remove_iptables_chains`: a set some rule still matches cannot be destroyed.
    """
    listed = run("ipset", "list", "-n") if shutil.which("ipset") else None
    if listed is None or listed.returncode != 0:
        return
    for name in listed.stdout.split():
        if name.removeprefix("inet6:").startswith(prefix):
            run("ipset", "destroy", name)


def unmount_under(*roots: Path) -> None:
    """Lazily unmount every mount point below `roots`, deepest first."""
    prefixes = [str(root.resolve()).rstrip("/") + "/" for root in roots]
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].encode().decode("unicode_escape")
        if any((point + "/").startswith(prefix) for prefix in prefixes):
            points.append(point)
    for point in sorted(set(points), key=len, reverse=True):
        run("umount", "-l", point)


def kill_shims(containerd_socket: Path) -> None:
    """containerd-shim processes started by this containerd (they outlive it by design)."""
    needle = str(containerd_socket).encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if b"containerd-shim" in cmdline and needle in cmdline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(proc.name), signal.SIGKILL)


def remove_cgroups(name: str) -> None:
    """rmdir the kubelet's cgroup tree `name` in every hierarchy (children first)."""
    if not CGROUP_ROOT.is_dir():
        return
    for hierarchy in CGROUP_ROOT.iterdir():
        top = hierarchy / name
        if not top.is_dir():
            continue
        children = sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts))
        for path in [*children, top]:
            with contextlib.suppress(OSError):
                path.rmdir()


def remove_links_into(directory: Path, target_root: Path) -> None:
    """Symlinks in `directory` pointing below `target_root` (kubelet's /var/log/containers)."""
    if not directory.is_dir():
        return
    prefix = str(target_root.resolve()) + "/"
    for link in directory.iterdir():
        if link.is_symlink() and os.readlink(link).startswith(prefix):
            link.unlink()
