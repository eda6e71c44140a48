"""Memory stays flat with sound-device output: a played request's resampler and kept PCM are
freed on the worker thread that allocated them (freed later on the sound watcher thread, they
fragmented the worker's glibc heap: ~60 kB more RSS per request, see bench/HISTORY.md). The
worker, the real pipeline and the real ALSA file device run in a subprocess (ALSA reads HOME)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.fixtures_service import ROOT, alsa_home

_SCRIPT = r"""
import sys, threading, time
from appliance.config import config_from_dict
from appliance.core import SynthParams
from appliance.messages.protocol import Speak
from appliance.service.request import Request as Item
from appliance.audio.output import AudioOutput
from appliance.audio.request import RequestAudio
from appliance.service.worker import Worker
from appliance.synth.pipeline import Pipeline

released = []
all_released = threading.Event()
orig = RequestAudio.release
def release(self):
    released.append((self.request_id, threading.current_thread().name))
    orig(self)
    if len(released) >= 3:
        all_released.set()
RequestAudio.release = release

ck, tmp = sys.argv[1], sys.argv[2]
cfg = config_from_dict({"model": {"path": ck, "backend": "torch", "device": "cpu", "threads": 1, "max_batch": 3,
                                  "max_seq_len": 512, "max_prompt_tokens": 128},
                        "synthesis": {"max_new_tokens": 30, "min_new_tokens": 30},
                        "audio": {"output": "device", "wav_dir": tmp + "/wav", "latency_ms": 50}}, base_dir=tmp)
p = Pipeline.from_config(cfg)
audio = AudioOutput(cfg)
audio.start()
w = Worker(p, audio, queue_len={"main": 4})
w.start()
items = []
for i in range(3):
    ev = threading.Event()
    sink = lambda e, ev=ev: ev.set() if e.type in ("done", "error") else None
    sp = Speak(text="你好。", id=f"m{i}", seed=i)
    it = Item(speak=sp, job=p.prepare(sp), channel="main", sink=sink)
    items.append(it)
    w.submit(it)
    assert ev.wait(30)
assert all_released.wait(30)            # the worker wakes on the settle and releases
w.stop(5)
audio.close()
assert all(it.audio.output.startswith("device:") for it in items), [it.audio.output for it in items]
assert all(it.audio._pcm == [] and it.audio._rs is None for it in items)
print("RESULT", sorted(set(n for _, n in released)), sorted(r for r, _ in released))
"""


def test_played_requests_free_their_audio_on_the_worker_thread(tiny_ckpt, tmp_path):
    alsa = alsa_home(tmp_path / "home", tmp_path / "played.raw")
    r = subprocess.run([sys.executable, "-c", _SCRIPT, str(tiny_ckpt), str(tmp_path)], cwd=str(ROOT),
                       env={**os.environ, "HOME": str(alsa.home)}, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout.split("RESULT")[1]
    assert "['tts-worker']" in out and "['m0', 'm1', 'm2']" in out, out
