"""The daemon's last step: leave the process without the interpreter's teardown.

When :meth:`~appliance.daemon.daemon.Daemon.run` returns, everything the daemon owns is stopped
and written: the journal fsynced, WAV files closed, sockets closed, the worker drained. What
Python does next is tear its modules down one object at a time; with torch loaded that took
0.65-0.76 s of every stop on the 2-core x86 dev box (SIGTERM to exit, three runs; a bare
``import torch`` process: 0.7 s of teardown, 0.007 s of it ``atexit`` handlers), time that
``systemctl stop`` / ``restart`` and the crash-loop's restarts wait for and nobody needs.
:func:`leave` does what a normal exit does that matters (joins the threads that are not
daemon threads, runs the ``atexit`` handlers: logging's flush, PortAudio's terminate) and then
ends the process with ``os._exit``.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def leave(rc: int) -> NoReturn:
    """End the process with exit status ``rc`` (0-255) after joining every non-daemon thread,
    running the ``atexit`` handlers and flushing stdout/stderr; never returns."""
    me = threading.current_thread()
    for t in threading.enumerate():
        if t is not me and not t.daemon:
            t.join()
    atexit._run_exitfuncs()            # the handlers a normal exit runs (logging.shutdown among them)
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):   # closed or gone: nothing more to say
            pass
    os._exit(rc)
