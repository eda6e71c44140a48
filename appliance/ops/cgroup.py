"""The memory a control group leaves this process: a systemd unit's ``MemoryMax=``, a container's
limit, or a test's cgroup, read the way the kernel counts it (cgroup v2 and v1).

:func:`cgroup_memory` walks from this process's cgroup (``/proc/self/cgroup``) up to the
hierarchy's root and returns the tightest limit on the way with its headroom: the limit less
what the group holds, page cache that can be dropped (``inactive_file``) not counted as held
(the kernel reclaims it before its OOM killer acts). Files (kernel docs,
``admin-guide/cgroup-v2.rst`` and ``cgroup-v1/memory.rst``): v2 ``memory.max`` (``max`` = none),
``memory.current``, ``memory.stat`` ``inactive_file``; v1 ``memory.limit_in_bytes`` (a value near
2^63 = none), ``memory.usage_in_bytes``, ``memory.stat`` ``total_inactive_file``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional


#: A v1 limit at or above this many bytes means "no limit" (the kernel shows 2^63 rounded down to a page).
_NO_LIMIT = 1 << 60


@dataclass(frozen=True)
class CgroupMemory:
    """The tightest memory limit over this process, MiB.

    Attributes:
        path: the cgroup directory that sets it. limit_mib: its limit. available_mib: the limit
            less what the group holds (reclaimable page cache not counted), >= 0.
    """

    path: str
    limit_mib: float
    available_mib: float


def read_text(path: str) -> Optional[str]:
    """The stripped text of a small cgroup/procfs file, or None if it cannot be read."""
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


def _int(text: Optional[str]) -> Optional[int]:
    return int(text) if text is not None and text.strip().lstrip("-").isdigit() else None


def _stat(d: str, key: str) -> int:
    for line in (read_text(os.path.join(d, "memory.stat")) or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return 0


def _dirs(root: str) -> list[tuple[str, str]]:
    """``(version, directory)`` of this process's memory cgroup: ``v2`` for the unified line
    (``0::/path``) when its directory has ``memory.max``'s sibling ``memory.current``, ``v1`` for the
    line naming the ``memory`` controller."""
    out = []
    for line in (read_text(os.path.join(root, "proc/self/cgroup")) or "").splitlines():
        hid, _, rest = line.partition(":")
        ctrls, _, path = rest.partition(":")
        rel = path.lstrip("/")
        if hid == "0" and ctrls == "":
            d = os.path.join(root, "sys/fs/cgroup", rel)
            if os.path.exists(os.path.join(d, "memory.current")):
                out.append(("v2", d))
        elif "memory" in ctrls.split(","):
            out.append(("v1", os.path.join(root, "sys/fs/cgroup/memory", rel)))
    return out


def cgroup_memory(root: str = "/") -> Optional[CgroupMemory]:
    """The tightest cgroup memory limit over this process (module docstring); None when no
    group on the way up has one, or the files cannot be read.

    Args:
        root: filesystem root to read under (``telemetry.root``; tests).
    """
    best: Optional[CgroupMemory] = None
    for version, leaf in _dirs(root):
        top = os.path.join(root, "sys/fs/cgroup", "" if version == "v2" else "memory")
        d = os.path.normpath(leaf)
        while True:
            if version == "v2":
                raw = read_text(os.path.join(d, "memory.max"))
                limit = None if raw in (None, "max") else _int(raw)
                used, cache = _int(read_text(os.path.join(d, "memory.current"))), _stat(d, "inactive_file")
            else:
                limit = _int(read_text(os.path.join(d, "memory.limit_in_bytes")))
                limit = None if limit is not None and limit >= _NO_LIMIT else limit
                used, cache = _int(read_text(os.path.join(d, "memory.usage_in_bytes"))), _stat(d, "total_inactive_file")
            if limit is not None and used is not None:
                avail = max(0, limit - max(0, used - cache)) / 2**20
                if best is None or avail < best.available_mib:
                    best = CgroupMemory(d, limit / 2**20, avail)
            if os.path.normpath(d) == os.path.normpath(top) or len(d) <= len(top):
                break
            d = os.path.dirname(d)
    return best
