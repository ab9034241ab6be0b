"""Unpacking an adapter's tar archive (a URL source, or an OCI layer) into the engine's cache.

Written by hand around `tarfile` because the archive is the adapter author's, not the
platform team's: Python's `data` filter refuses absolute paths, `..` and devices, and on
top of it only regular files and folders are kept (a link could point a later file's write
outside the folder), and the member count and unpacked bytes are capped
(`lora.MAX_ADAPTER_FILES`, `MAX_ADAPTER_BYTES`) so a crafted archive cannot fill the pod's
disk. Every refusal is a permanent `FetchError` naming the member.
"""

from __future__ import annotations

import shutil
import tarfile
from dataclasses import dataclass
from pathlib import Path

from servefleet.api.lora import ADAPTER_CONFIG, MAX_ADAPTER_BYTES, MAX_ADAPTER_FILES
from servefleet.engine.fetch.errors import FetchError

WHITEOUT = ".wh."
"""An image layer's deletion marker (OCI image spec); it deletes, it is never a file."""


@dataclass
class UnpackBudget:
    """What the archives of one adapter may still unpack (shared by an image's layers)."""

    files: int = MAX_ADAPTER_FILES
    bytes: int = MAX_ADAPTER_BYTES


def unpack_tar(archive: Path, into: Path, what: str, budget: UnpackBudget | None = None) -> None:
    """Unpack `archive` (plain or gzip tar) into `into`, refusing what could leave it."""
    budget = budget or UnpackBudget()
    into.mkdir(parents=True, exist_ok=True)
    try:
        with tarfile.open(archive, mode="r:*") as tar:
            for member in tar:
                _unpack_member(tar, member, into, what, budget)
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise FetchError(f"{what}: not a readable tar archive: {exc}", permanent=True) from None


def _unpack_member(
    tar: tarfile.TarFile, member: tarfile.TarInfo, into: Path, what: str, budget: UnpackBudget
) -> None:
    name = member.name
    if name.startswith("/") or ".." in Path(name).parts:
        raise FetchError(f"{what}: {name}: a path outside the adapter's folder", permanent=True)
    leaf = Path(name).name
    if leaf.startswith(WHITEOUT):
        _apply_whiteout(into, name)
        return
    if not (member.isfile() or member.isdir()):
        raise FetchError(
            f"{what}: {name}: only files and folders may be in an adapter (links and devices "
            "are refused)",
            permanent=True,
        )
    try:
        tarfile.data_filter(member, str(into))
    except tarfile.FilterError as exc:
        raise FetchError(f"{what}: {name}: {exc}", permanent=True) from None
    budget.files -= 1
    budget.bytes -= member.size
    if budget.files < 0 or budget.bytes < 0:
        raise FetchError(
            f"{what}: unpacks to more than {MAX_ADAPTER_FILES} files or "
            f"{MAX_ADAPTER_BYTES >> 20} MiB: not an adapter",
            permanent=True,
        )
    tar.extract(member, into, filter="data")


def _apply_whiteout(into: Path, name: str) -> None:
    """A later image layer deleting a file an earlier one added (`.wh.<name>`)."""
    target = Path(name).parent / Path(name).name.removeprefix(WHITEOUT)
    path = into / target
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def publish_unpacked(unpacked: Path, folder: Path) -> None:
    """Move the PEFT files from `unpacked` into `folder` (the cache entry), one folder up when
    the archive held them in a single folder (`tar czf a.tgz my-adapter/`): the adapter is
    always the cache entry itself, so its path is known before the fetch."""
    root = unpacked
    children = list(unpacked.iterdir())
    if not (unpacked / ADAPTER_CONFIG).exists() and len(children) == 1 and children[0].is_dir():
        root = children[0]
    for child in root.iterdir():
        child.rename(folder / child.name)


def clear_folder(folder: Path, keep: str) -> None:
    """Empty `folder` except `keep` (a retry unpacks again from the start)."""
    for child in folder.iterdir():
        if child.name == keep:
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()
