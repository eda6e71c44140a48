"""Logging never blocks speech (appliance.ops.logsetup): a daemon whose stderr is a pipe that
nobody reads (a stalled journald, a frozen terminal) keeps answering and speaking; what it logged
meanwhile comes out once the pipe is read again (beyond the queue: dropped, and the count logged:
tests/test_ops_notify.py)."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import termios
import threading

import yaml

from tests.fixtures_service import ROOT, DaemonProc, _wait_socket, service_config
from tests.waits import wait_for

F_SETPIPE_SZ = 1031


def test_a_daemon_whose_stderr_is_not_read_keeps_answering_and_speaking(tiny_ckpt, tmp_path):
    cfg = service_config(tiny_ckpt, tmp_path, synthesis={"max_new_tokens": 24, "min_new_tokens": 24})
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    r, w = os.pipe()
    size = fcntl.fcntl(w, F_SETPIPE_SZ, 4096)      # a page: -v start-up lines fill it at once
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("LISTEN_FDS", None)
    proc = subprocess.Popen([sys.executable, "-m", "appliance", "-v", "serve", "--config", str(path)], cwd=ROOT,
                            env=env, stdout=w, stderr=w)
    os.close(w)
    d = DaemonProc(proc=proc, config=cfg, config_path=path, socket=tmp_path / "run" / "appliance.sock",
                   log_path=tmp_path / "no.log", wav_dir=tmp_path / "wav")
    got: list[bytes] = []
    try:
        _wait_socket(d, 180)
        queued = bytearray(4)
        fcntl.ioctl(r, termios.FIONREAD, queued)
        full = int.from_bytes(queued, sys.byteorder)
        assert full > size - 1024                                   # full: the next line does not fit
        for i in range(3):
            (st,) = d.request({"type": "status"}, timeout_s=30)
            assert st["type"] == "status" and st["state"] == "ready", st
            evs = d.request({"type": "speak", "text": "你好。", "id": f"s{i}", "seed": 1}, timeout_s=120)
            assert evs[-1]["type"] == "done", evs
        fcntl.ioctl(r, termios.FIONREAD, queued)
        assert int.from_bytes(queued, sys.byteorder) == full        # not a line written meanwhile: blocked
        reader = threading.Thread(target=lambda: got.extend(iter(lambda: os.read(r, 65536), b"")), daemon=True)
        reader.start()                                              # the reader returns
        # what was logged meanwhile comes out now: queued in order, or dropped and counted
        wait_for(lambda: any(k in b"".join(got) for k in (b"request_id=s2", b"log records dropped while")), 60,
                 "the records of the stall, or their count", poll_s=0.1)
        (st,) = d.request({"type": "status"}, timeout_s=30)
        assert st["state"] == "ready"
    finally:
        assert d.stop() == 0, b"".join(got)[-3000:].decode(errors="replace")
        os.close(r)
    text = b"".join(got).decode(errors="replace")
    if "log records dropped while" in text:     # more than the queue holds was logged meanwhile: counted
        assert int(text.split(" log records dropped while")[0].rsplit(" ", 1)[1]) > 0
