"""`inside(folder, rel)`: the one check that a file a model folder names stays inside that folder.

Used for the names an HF checkpoint lists (hf_reader) and the file names in octavo.json (manifest).
A name is refused (UnsafePathError) when it is absolute, contains '..', or resolves — through a
symlink anywhere on the way — to a place outside the folder. A symlink that stays inside is fine, and
so is a folder that is itself reached through a symlink (the comparison is between resolved paths).
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from octavo.errors import UnsafePathError


def inside(folder: str | Path, rel: str, *, where: str | Path | None = None, subject: str = "the file",
           fix: str = "the files must live inside the folder", also_allowed: Sequence[Path] = ()) -> Path:
    """FOLDER/REL, or UnsafePathError when REL leaves FOLDER.

    The messages read `<where>: <subject> '<rel>' is outside the model folder; refusing to read it
    (<fix>)` (a symlink out: `... copy the file into the folder instead`); where defaults to FOLDER,
    subject says who named REL (e.g. a manifest field).
    also_allowed: resolved folders besides FOLDER that the resolved path may lie in (the HF hub
    cache's blobs/ folder, which its snapshot symlinks point into)."""
    folder = Path(folder)
    where = folder if where is None else where
    if not isinstance(rel, str) or not rel:
        raise UnsafePathError(f"{where}: {subject} must be a file name inside the model folder, got {rel!r}")
    relative = Path(rel)
    if relative.is_absolute() or ".." in relative.parts:
        raise UnsafePathError(f"{where}: {subject} {rel!r} is outside the model folder; refusing to read it ({fix})")
    path = folder / relative
    try:
        root, resolved = folder.resolve(), path.resolve()
    except (OSError, RuntimeError) as exc:  # a symlink loop (RuntimeError up to Python 3.12, OSError later)
        raise UnsafePathError(f"{path} ({subject} {rel!r}) cannot be resolved ({exc}); refusing to read it") from exc
    if not any(resolved.is_relative_to(allowed) for allowed in (root, *also_allowed)):
        raise UnsafePathError(f"{path} ({subject} {rel!r}) resolves to {resolved}, outside the model folder {root} "
                              f"(a symlink pointing out); refusing to read it — copy the file into the folder instead")
    return path
