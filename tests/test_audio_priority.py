"""The sound-device threads run above the decode threads: the daemon, started nice 4 as the unit's
``Nice=`` would start it, plays into a paced ALSA file device, and its threads' niceness is read
from ``/proc/<pid>/task/*/stat``: PortAudio's callback thread and the device watcher at
4 - PRIORITY_ABOVE, every other thread (the worker and its inference threads among them) at 4.
Without ``CAP_SYS_NICE`` a thread goes only as far as ``RLIMIT_NICE`` (the unit's ``LimitNICE=``)
allows, and stays put where it allows nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.audio.priority import PRIORITY_ABOVE
from tests.fixtures_service import ROOT, alsa_home, service_config, start_daemon  # noqa: F401
from tests.waits import wait_for, wait_log

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")


def _nice(pid: int) -> dict[int, int]:
    """tid -> niceness of each thread of ``pid`` (field 19 of /proc/<pid>/task/<tid>/stat)."""
    out = {}
    for t in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (t / "stat").read_text()
        except OSError:          # the thread ended meanwhile
            continue
        out[int(t.name)] = int(stat.rsplit(")", 1)[1].split()[16])
    return out


def test_daemon_sound_threads_run_above_its_decode_threads(tiny_ckpt, tmp_path, start_daemon):  # noqa: F811
    alsa = alsa_home(tmp_path / "home", tmp_path / "played.raw")
    cfg = service_config(tiny_ckpt, tmp_path, audio={"output": "device", "device": None})
    d = start_daemon(cfg, alsa=alsa, argv_prefix=["nice", "-n", "4"])
    wait_log(d.log, "sound device", alive=d.alive)
    raised = 4 - PRIORITY_ABOVE
    got = wait_for(lambda: (lambda n: n if sum(v == raised for v in n.values()) >= 2 else None)(_nice(d.proc.pid)),
                   what="the callback and watcher threads raised")
    assert got[d.proc.pid] == 4                                # the main thread: the unit's Nice=
    assert set(got.values()) == {4, raised}, got               # nothing else moved, nothing lower
    assert sum(v == 4 for v in got.values()) > sum(v == raised for v in got.values())
    r = d.request({"type": "speak", "text": "你好。", "channel": "main", "seed": 1})   # the worker decodes meanwhile
    assert r[-1]["type"] == "done", r
    assert set(_nice(d.proc.pid).values()) <= {4, raised}


_UNPRIVILEGED = """
import os, resource, sys, threading
from appliance.audio.priority import raise_thread_priority
try:
    resource.setrlimit(resource.RLIMIT_NICE, (int(sys.argv[1]), int(sys.argv[1])))
except (ValueError, OSError):
    print("NOLIMIT"); sys.exit(0)          # raising the hard limit needs CAP_SYS_RESOURCE
os.nice(3)
os.setgid(65534); os.setuid(65534)       # no CAP_SYS_NICE from here on
out = []
t = threading.Thread(target=lambda: out.append((raise_thread_priority(), os.getpriority(os.PRIO_PROCESS, 0))))
t.start(); t.join()
print("RESULT", *out[0])
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="drops root to test RLIMIT_NICE alone")
@pytest.mark.parametrize("rlimit, want", [(20, 0), (30, -2), (0, None)])
def test_without_privileges_a_thread_rises_as_far_as_rlimit_nice_allows(rlimit, want):
    r = subprocess.run([sys.executable, "-c", _UNPRIVILEGED, str(rlimit)], cwd=str(ROOT), capture_output=True,
                       text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    if "NOLIMIT" in r.stdout:
        pytest.skip(f"RLIMIT_NICE cannot be set to {rlimit} here (no CAP_SYS_RESOURCE)")
    got, now = r.stdout.split("RESULT")[1].split()
    assert got == str(want) and int(now) == (3 if want is None else want)
