"""Peak resident memory that belongs to one peer: compare_peers' "peak RSS" column.

Why not getrusage: on Linux `ru_maxrss` is kept in the process's signal struct, which survives exec,
and exec folds the outgoing address space's high-water mark into it. Python's subprocess starts a child
with vfork + exec, so the outgoing address space is the parent's and every child starts at the parent's
*peak* (with a plain fork, at the parent's RSS when it forked). The compare_peers parent converts the
GGUF with torch in smollm2 mode (real_model.py), so every worker it started, and every server a worker
started (RUSAGE_CHILDREN), read the parent's 1979 MiB.

`VmHWM` in /proc/PID/status is the high-water mark of that process's own address space. exec makes a
new one, so it holds only what the program allocated after it started. Where /proc cannot be read,
the functions here fall back to ru_maxrss and say so. That number can still be the parent's.
"""
from __future__ import annotations

import logging
import resource
import sys
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)
PROC = Path("/proc")


def _maxrss_mib(ru_maxrss: int) -> float:
    return ru_maxrss / (1 << 20) if sys.platform == "darwin" else ru_maxrss / 1024.0  # bytes there, KiB on Linux


def _vmhwm_kib(pid: int | str) -> int | None:
    """VmHWM of PID in KiB. None if it cannot be read: no /proc, the process is gone, or it is a zombie
    (which has no address space left)."""
    try:
        with open(PROC / str(pid) / "status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def own_peak_mib() -> float:
    """Peak RSS of this process since its exec, in MiB: VmHWM from /proc/self/status.

    For an in-process peer (octavo offline, HF, onnxruntime-genai) the worker process is the peer's
    process, so this counts the interpreter, everything the worker imported before the peer loaded (the
    peer modules, numpy), the peer's own imports, model, caches and pools, at the worst moment over
    every workload the worker has run so far. Where /proc is not readable this falls back to
    getrusage's ru_maxrss, which on Linux can be the parent's peak inherited through exec (see above).
    """
    kib = _vmhwm_kib("self")
    if kib is not None:
        return kib / 1024.0
    log.warning("no /proc/self/status: peak RSS from ru_maxrss, which may be the parent's peak")
    return _maxrss_mib(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def descendants(pid: int) -> list[int]:
    """The live processes below PID (children, theirs, ...), read from every /proc/N/stat's parent pid."""
    parent_of: dict[int, int] = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited while we looked
        fields = stat.rpartition(")")[2].split()  # the command name before it may hold spaces and ')'
        if len(fields) > 1:
            parent_of[int(entry.name)] = int(fields[1])
    children: dict[int, list[int]] = {}
    for child, parent in parent_of.items():
        children.setdefault(parent, []).append(child)
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def tree_peak_mib(pid: int) -> float | None:
    """Sum of the VmHWM of PID and of its live descendants, in MiB. None if PID's own status cannot be read.

    Call it while the process still runs, just before stopping it: descendants that already exited are
    not counted, and neither is a zombie. For one process (llama-server, `octavo serve`) this is that
    process's peak. For a tree (vLLM's API server and its engine core process) it is an upper bound on
    what the peer needed: the processes may have peaked at different moments, and pages they share
    (copy-on-write after a fork, shared memory, a model file mapped by both) count once per process.
    """
    tree = _tree_kib(pid)
    return None if tree is None else tree[0] / 1024.0


def _tree_kib(pid: int) -> tuple[int, int] | None:
    """(summed VmHWM in KiB, how many processes it sums) for PID's tree; None if PID is not readable."""
    own = _vmhwm_kib(pid)
    if own is None:
        return None
    below = [k for k in map(_vmhwm_kib, descendants(pid)) if k is not None]
    return own + sum(below), 1 + len(below)


def children_maxrss_mib() -> float:
    """ru_maxrss of the largest child this process has waited for, in MiB. This is the fallback where
    /proc is not readable. On Linux it includes the peak that each child inherited through exec, which
    can be this process's own peak (see the module docstring), and it covers every child waited for so far."""
    return _maxrss_mib(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)


@dataclass
class ServerPeak:
    """What `online.server_process(..., peak=...)` fills in when it stops a server: the peak RSS of the
    server's process tree in MiB (`tree_peak_mib`), and how it was measured."""

    mib: float | None = None
    source: str | None = None

    def read(self, pid: int) -> None:
        """Read PID's tree while it still runs (before it is signalled)."""
        tree = _tree_kib(pid)
        if tree is not None:
            self.mib = tree[0] / 1024.0
            self.source = "VmHWM" if tree[1] == 1 else f"VmHWM summed over {tree[1]} processes (an upper bound)"

    def after_wait(self) -> None:
        """After the server has been waited for: if this machine has no /proc, fall back to ru_maxrss. With
        /proc, a server that had already exited when it was to be read stays at None (nothing is known)."""
        if self.mib is None and _vmhwm_kib("self") is None:
            self.mib = children_maxrss_mib()
            self.source = "ru_maxrss of waited children (may be inherited from the worker)"
            log.warning("server peak RSS not readable from /proc: ru_maxrss fallback %.0f MiB", self.mib)

    def extra(self) -> dict[str, float | str | None]:
        """The keys a PeerResult's extra gets: peak_rss_mib (what compare_peers aggregates; None if it was
        not read, so the worker does not put its own peak there) and how it was measured."""
        return {"peak_rss_mib": self.mib, "peak_rss_source": self.source}

