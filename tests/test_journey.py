"""The journey docs/architecture.md draws, asserted: a socket ``speak`` line takes four shapes
(``Speak``, ``Job``, ``Request``, ``PcmChunk``) and crosses threads three times on the way to its
audio (loop -> prepare -> worker -> the sink's own). The real dispatcher, worker, pipeline (tiny
checkpoint) and client stream; the sink and the audio sink record where each step ran."""

from __future__ import annotations

import asyncio
import threading

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


def test_a_socket_request_takes_four_shapes_and_crosses_three_threads(pipe, cfg):
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
            items.append(await outbox.get())
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
    audio = [it for it in items if it[0] == AUDIO]                # crossing 3: worker -> the sink's reader
    assert audio and all(it[2].dtype == np.float32 for it in audio)
    assert sum(it[3] for it in audio) == 30 * 512 - 256
