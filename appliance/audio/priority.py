"""The sound-device threads above the decode threads: a per-thread niceness within what the
process may use.

The daemon's unit (``systemd/chattts-appliance.service``) starts it at ``Nice=-5`` with
``LimitNICE=-10`` and no capability: every thread, the worker's decode and inference threads among
them, runs at -5, and a thread may lower its own niceness down to -10 (``RLIMIT_NICE``).
:func:`raise_thread_priority`, called by PortAudio's callback thread and the device watcher
(:mod:`appliance.audio.device`), moves the calling thread :data:`PRIORITY_ABOVE` steps above the
process: the callback that must hand ALSA its next block in time is picked before a decode step.
Niceness is per thread on Linux (``setpriority(PRIO_PROCESS, tid)``); realtime scheduling stays
restricted (``RestrictRealtime=yes``). Measured effect and the unit's weights: ``bench/HISTORY.md``.
"""

from __future__ import annotations

import os
import threading
from typing import Optional

PRIORITY_ABOVE = 5
"""Niceness steps the sound-device threads (PortAudio's callback, the watcher) run above the
process's, i.e. above the decode threads (the unit: ``Nice=-5``, ``LimitNICE=-10``)."""


def raise_thread_priority(above: int = PRIORITY_ABOVE) -> Optional[int]:
    """Give the calling thread the niceness ``above`` steps below the process's (its main thread's:
    the unit's ``Nice=``), or as far as ``RLIMIT_NICE`` (the unit's ``LimitNICE=``) lets a process
    without ``CAP_SYS_NICE`` go. Linux only (niceness is per thread there). Returns the niceness
    set, or None when nothing could be raised (another OS, no room under the limit). Never raises."""
    if not hasattr(os, "setpriority") or not hasattr(threading, "get_native_id"):
        return None
    try:
        import resource

        base, tid = os.getpriority(os.PRIO_PROCESS, os.getpid()), threading.get_native_id()
        soft = resource.getrlimit(resource.RLIMIT_NICE)[0]
        floor = -20 if soft == resource.RLIM_INFINITY else 20 - soft
        for want in dict.fromkeys((max(-20, base - above), max(-20, base - above, floor))):
            if want >= os.getpriority(os.PRIO_PROCESS, tid):
                return None
            try:
                os.setpriority(os.PRIO_PROCESS, tid, want)
                return want
            except PermissionError:
                continue
    except (OSError, ValueError, AttributeError):
        pass
    return None
