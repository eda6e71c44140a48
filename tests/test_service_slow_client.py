"""A socket client that asks for its audio (``return_audio``) and stops reading: the same client
stream as Wyoming's (:mod:`appliance.audio.stream`) bounds what its connection holds by
``service.max_buffered_ms``; the request that goes over it is cancelled with the numbers in the log,
and another client's request on the same channel is served. The real daemon; the stalled client
is a raw UNIX socket with a small receive buffer that never reads. The bound is checked by the
stream's own accounting (the numbers it logs), never by timing."""

from __future__ import annotations

import json
import re
import socket

from tests.fixtures_service import service_config
from tests.waits import wait_log

BOUND_MS = 2000
"""service.max_buffered_ms of the daemon under test: above the largest chunk (48 steps, 1024 ms),
which is taken whole when nothing waits, so the connection never holds more than this."""

OVERFLOW = re.compile(r"socket #\d+: request (\S+) was cancelled: its socket client stopped reading its audio "
                      r"\((\d+) ms waiting to be sent, (\d+) ms more would pass service.max_buffered_ms = (\d+)\); "
                      r"(\d+) ms of its audio dropped, connection peak (\d+) ms")


def test_a_socket_client_that_stops_reading_has_its_request_ended_within_the_bound(tiny_ckpt, tmp_path,
                                                                                   start_daemon):
    cfg = service_config(tiny_ckpt, tmp_path, service={"max_buffered_ms": BOUND_MS},
                         synthesis={"max_new_tokens": 400, "min_new_tokens": 400, "voice": "seed:2"})
    d = start_daemon(cfg)
    stalled = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stalled.connect(cfg["service"]["socket"])
    try:
        # 400 steps, 8.5 s of audio, played on the box too: far over the bound the client can hold
        stalled.sendall(json.dumps({"type": "speak", "id": "stalled-1", "text": "我不读。", "seed": 3,
                                    "return_audio": True}).encode() + b"\n")
        log = wait_log(d.log, "request stalled-1 ended with cancelled", timeout_s=120, alive=d.alive)
        m = OVERFLOW.search(log)
        assert m is not None and m.group(1) == "stalled-1", log[-3000:]
        waiting, more, limit, dropped, peak = (int(m.group(k)) for k in (2, 3, 4, 5, 6))
        assert limit == BOUND_MS
        assert waiting <= BOUND_MS and peak <= BOUND_MS, m.group(0)      # never held more than the bound
        assert waiting + more > BOUND_MS, m.group(0)                      # refused at the bound, not before
        assert dropped > 0, m.group(0)
        # another client, same channel, its audio back: served (it waited behind the stalled one)
        evs = d.request({"type": "speak", "id": "reader-1", "text": "你好。", "seed": 4, "return_audio": True,
                         "params": {"max_new_tokens": 40, "min_new_tokens": 40}}, timeout_s=120)
        assert evs[-1]["type"] == "done", evs
        audio = [e for e in evs if e["type"] == "audio"]
        assert sum(len(e["_payload"]) for e in audio) == sum(e["bytes"] for e in audio) > 0
        assert "Traceback" not in d.log()
    finally:
        stalled.close()
