"""The journey docs/architecture.md draws, asserted: a socket ``speak`` line takes four shapes
(``Speak``, ``Job``, ``Request``, ``PcmChunk``), is handed on eight times (H1..H8) and crosses
threads three times on the way to its first sound (loop -> prepare -> worker -> PortAudio's
callback). Real parts: a UNIX socket, the dispatcher, the worker, the pipeline (tiny checkpoint),
the sound device (an ALSA file device, in a child process: ALSA reads the HOME it starts with);
each hand-off is observed by a wrapper that records the thread it ran on and what it was given.
A client that asks for its audio back gets it through its client stream (worker -> loop)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from appliance.audio.output import AudioOutput
from appliance.audio.stream import AUDIO, ClientStream, Outbox
from appliance.config import config_from_dict
from appliance.core import PcmChunk, SynthesisRequest
from appliance.messages.protocol import Speak, parse_line
from appliance.service.dispatch import Dispatcher
from appliance.service.request import Request
from appliance.service.worker import Worker
from appliance.synth.batch import Task, TaskState
from appliance.synth.job import Job, Sentence
from appliance.synth.pipeline import Pipeline
from tests.fixtures_service import ROOT, alsa_home

LINE = b'{"type": "speak", "id": "j1", "text": "\\u4f60\\u597d\\u3002", "seed": 3, "return_audio": true, ' \
       b'"play": false, "params": {"max_new_tokens": 30, "min_new_tokens": 30}}'


@pytest.fixture(scope="module")
def cfg(tiny_ckpt, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("journey")
    return config_from_dict({
        "model": {"path": str(tiny_ckpt), "backend": "torch", "device": "cpu", "threads": 1,
                  "max_batch": 3, "max_seq_len": 512, "max_prompt_tokens": 128},
        "audio": {"output": "wav", "wav_dir": str(tmp / "wav")},
        "service": {"channels": [{"name": "main"}]},
    }, base_dir=str(tmp))


@pytest.fixture(scope="module")
def pipe(cfg):
    p = Pipeline.from_config(cfg)
    yield p
    p.close()


def test_the_first_shape_is_what_the_pipeline_takes(pipe):
    speak = parse_line(LINE, 65536)
    assert type(speak) is Speak and isinstance(speak, SynthesisRequest)      # [1]: no conversion
    job = pipe.prepare(speak)
    assert type(job) is Job and all(type(s) is Sentence for s in job.sentences)   # [2]
    run = pipe.run(job)
    assert all(type(c) is PcmChunk and c.samples.dtype == np.float32 and c.rate == 24000 for c in run)   # [4]
    assert run.report.stats is not None and run.report.spoken == [s.text for s in job.sentences]


# The child process: a daemon's parts wired by hand around a real UNIX socket and the sound device.
_DEVICE_JOURNEY = r"""
import asyncio, json, sys, threading
from pathlib import Path
import numpy as np
from appliance.audio.device import DeviceOutput
from appliance.audio.mix import Lanes
from appliance.audio.output import AudioOutput
from appliance.audio.request import RequestAudio
from appliance.config import config_from_dict
from appliance.service.dispatch import Dispatcher
from appliance.service.journal import Journal
from appliance.service.worker import Worker
from appliance.synth.batch import BatchEngine
from appliance.synth.pipeline import Pipeline
from appliance.transports.socket_server import SocketServer, listen_socket

ckpt, tmp = sys.argv[1], Path(sys.argv[2])
seen = {}

def note(key, what):
    seen.setdefault(key, [threading.current_thread().name, type(what).__name__])

def watch(cls, name, key, arg=0, result=False):
    fn = getattr(cls, name)
    def wrapper(self, *a, **kw):
        out = fn(self, *a, **kw)
        note(key, out if result else a[arg])
        return out
    setattr(cls, name, wrapper)

watch(Dispatcher, "handle_line", "H1 handle_line(line)")
watch(Pipeline, "prepare", "H3 prepare(speak)")
watch(Pipeline, "prepare", "H3 prepare -> job", result=True)
watch(Worker, "submit", "H4 submit(request)")
watch(BatchEngine, "add", "H5 add(job)")
watch(BatchEngine, "add", "H5 add -> task", result=True)
watch(Worker, "_on_pcm", "H6 on_pcm(chunk)", arg=1)
watch(RequestAudio, "write", "H7 write(pcm)")
watch(DeviceOutput, "enqueue", "H8 enqueue(samples)", arg=1)
accept = Dispatcher._accept
def _accept(self, req, *a):
    note("H2 _accept(speak)", req)
    return accept(self, req, *a)
Dispatcher._accept = _accept
mix = Lanes.mix
def sounding(self, out, frames, *a, **kw):
    got = mix(self, out, frames, *a, **kw)
    if np.any(out[:frames] != 0):
        note("first sound", out)
    return got
Lanes.mix = sounding

cfg = config_from_dict({
    "model": {"path": ckpt, "backend": "torch", "device": "cpu", "threads": 1,
              "max_batch": 3, "max_seq_len": 512, "max_prompt_tokens": 128},
    "audio": {"output": "device", "latency_ms": 50.0, "wav_dir": str(tmp / "wav")},
    "service": {"channels": [{"name": "main"}], "socket": str(tmp / "s.sock")},
}, base_dir=str(tmp))
pipe = Pipeline.from_config(cfg)
audio = AudioOutput(cfg)
audio.start()
journal = Journal(tmp / "spool")
journal.open()
worker = Worker(pipe, audio, queue_len={"main": 4}, journal=journal)
worker.start()

async def main():
    loop = asyncio.get_running_loop()
    seen["loop"] = threading.current_thread().name
    dispatch = Dispatcher(cfg.service, pipe, worker, loop, lambda: "ready", lambda: None, lambda: None,
                          journal=journal)
    server = SocketServer(listen_socket(tmp / "s.sock", 0o600), dispatch.handle_line, cfg.service.max_line_bytes)
    await server.start()
    r, w = await asyncio.open_unix_connection(str(tmp / "s.sock"))
    w.write(json.dumps({"type": "speak", "id": "d1", "text": "\u4f60\u597d\u3002", "seed": 3,
                        "params": {"max_new_tokens": 30, "min_new_tokens": 30}}).encode() + b"\n")
    events = []
    while not events or events[-1] not in ("done", "error"):
        events.append(json.loads(await asyncio.wait_for(r.readline(), 120))["type"])
    w.close()
    await server.close()
    dispatch.close()
    return events

events = asyncio.run(main())
worker.stop(10)
audio.close(5)
print("RESULT" + json.dumps({"events": events, "seen": seen}))
"""


def test_a_socket_request_takes_four_shapes_to_the_first_sound(tiny_ckpt, tmp_path):
    alsa = alsa_home(tmp_path / "home", tmp_path / "played.raw")
    r = subprocess.run([sys.executable, "-c", _DEVICE_JOURNEY, str(tiny_ckpt), str(tmp_path)], cwd=str(ROOT),
                       env={**os.environ, "HOME": str(alsa.home)}, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "RESULT" in r.stdout, r.stderr[-3000:]
    got = json.loads(r.stdout.split("RESULT", 1)[1])
    assert got["events"] == ["accepted", "started", "done"], got
    seen = got["seen"]
    thread = {k: v[0] for k, v in seen.items() if k != "loop"}
    shape = {k: v[1] for k, v in seen.items() if k != "loop"}
    assert shape == {"H1 handle_line(line)": "bytes", "H2 _accept(speak)": "Speak", "H3 prepare(speak)": "Speak",
                     "H3 prepare -> job": "Job", "H4 submit(request)": "Request", "H5 add(job)": "Job",
                     "H5 add -> task": "Task", "H6 on_pcm(chunk)": "PcmChunk", "H7 write(pcm)": "ndarray",
                     "H8 enqueue(samples)": "ndarray", "first sound": "ndarray"}, seen
    loop, prepare, worker, device = (thread["H1 handle_line(line)"], thread["H3 prepare(speak)"],
                                     thread["H5 add(job)"], thread["first sound"])
    assert loop == seen["loop"] and prepare.startswith("prepare") and worker == "tts-worker"
    assert len({loop, prepare, worker, device}) == 4, thread                # three crossings
    assert thread["H2 _accept(speak)"] == thread["H4 submit(request)"] == prepare   # crossing 1 at H2
    assert {thread[k] for k in ("H6 on_pcm(chunk)", "H7 write(pcm)", "H8 enqueue(samples)")} == {worker}  # 2 at H4
    assert np.count_nonzero(alsa.read()) > 0                                # crossing 3 at H8: it sounded


def test_a_client_stream_takes_the_audio_back_to_the_loop(pipe, cfg):
    seen: dict = {}
    events: list = []
    ended = threading.Event()
    worker = Worker(pipe, AudioOutput(cfg), queue_len={"main": 4})

    def sink(ev):                       # the connection's event sink
        events.append((ev.type, threading.current_thread().name))
        if ev.type in ("done", "error"):
            ended.set()

    async def main():
        loop = asyncio.get_running_loop()
        stream = ClientStream("socket #1", "socket client", 30000, "service.max_buffered_ms")
        outbox = Outbox(loop, stream)

        def audio_for(request_id):                   # what the socket passes down: its client stream
            (item,) = worker.sched.running.values()
            seen["request"] = item
            seen["open_thread"] = threading.current_thread().name
            return stream.audio(request_id, outbox)

        dispatch = Dispatcher(cfg.service, pipe, worker, loop, lambda: "ready", lambda: None, lambda: None)
        seen["loop_thread"] = threading.current_thread().name
        await dispatch.handle_line(LINE, sink, None, audio_for)
        await loop.run_in_executor(None, ended.wait, 120)
        items = []
        while len(outbox):
            items.append(await outbox.get())         # taken on the loop, as the connection's writer does
        dispatch.close()
        return items

    worker.start()
    try:
        items = asyncio.run(main())
    finally:
        worker.stop(10)
    item = seen["request"]
    assert type(item) is Request and type(item.speak) is Speak and type(item.job) is Job   # [3] holds [1], [2]
    assert type(item.task) is Task and item.task.state is TaskState.DONE
    threads = dict(events)
    assert [t for t, _ in events] == ["accepted", "started", "done"], events
    assert threads["accepted"].startswith("prepare")             # crossing 1: loop -> prepare
    assert threads["started"] == "tts-worker" == seen["open_thread"]   # crossing 2: prepare -> worker
    assert seen["loop_thread"] not in (threads["accepted"], threads["started"])
    audio = [it for it in items if it[0] == AUDIO]                # crossing 3 here: worker -> the loop's writer
    assert audio and all(it[2].dtype == np.float32 for it in audio)
    assert sum(it[3] for it in audio) == 30 * 512 - 256


def test_the_layout_names_every_module():
    """docs/architecture.md's layout block names every module of every package (a reader finds
    each module there)."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    block = doc.split("## Layout", 1)[1]
    words = set(re.findall(r"[A-Za-z_][A-Za-z_0-9]*", block))
    pkg = ROOT / "appliance"
    missing = [str(p.relative_to(pkg)) for p in sorted(pkg.glob("*/**/*.py"))
               if not p.stem.startswith("__") and p.stem not in words]
    assert not missing, f"modules the layout in docs/architecture.md does not name: {missing}"
