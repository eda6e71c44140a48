"""Sound output: WAV files, auto device choice, and a device that dies in the middle of a
request (its pacer process is killed, so ALSA's file plugin gets EPIPE and PortAudio stops)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from appliance.audio.wav import read_wav, wav_path, write_wav
from tests.fixtures_service import ROOT, alsa_home, expected_pcm, service_config
from tests.waits import wait_for


def test_wav_round_trip_and_safe_names(tmp_path):
    x = np.sin(np.arange(2400, dtype=np.float32) / 7) * 1.2      # clips above 1
    p = write_wav(tmp_path / "a.wav", x, 24000)
    y, rate = read_wav(p)
    assert rate == 24000 and len(y) == len(x)
    assert np.abs(y - np.clip(x, -1, 1)).max() <= 1 / 32767 + 1e-7
    assert wav_path(tmp_path, "../../etc/passwd").parent == tmp_path
    assert wav_path(tmp_path, ".hidden").name.startswith("_hidden+")
    assert wav_path(tmp_path, "abc-1.2_x").name == "abc-1.2_x.wav"


_AUTO = ("import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
         "from appliance.config import config_from_dict\n"
         "from appliance.audio.output import AudioOutput\n"
         "a = AudioOutput(config_from_dict({'audio': {'output': 'auto', 'wav_dir': sys.argv[1]}}))\n"
         "a.start(); print('MODE', a.mode); a.close(1.0)\n")


def _auto_mode(tmp_path: Path, env: dict) -> str:
    r = subprocess.run([sys.executable, "-c", _AUTO, str(tmp_path / "wav")], cwd=str(ROOT), env={**os.environ, **env},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_auto_picks_the_device_when_portaudio_lists_one(tmp_path):
    alsa = alsa_home(tmp_path / "home", tmp_path / "played.raw")
    out = _auto_mode(tmp_path, {"HOME": str(alsa.home)})
    assert "MODE device" in out and "PortAudio lists 1 output device(s): 'default'" in out


def test_auto_falls_back_to_wav_without_devices(tmp_path):
    out = _auto_mode(tmp_path, {"HOME": str(tmp_path)})     # the system's ALSA config, no ~/.asoundrc
    if "MODE device" in out:
        pytest.skip("this machine has a real sound device")
    assert "MODE wav" in out
    assert "PortAudio lists no output device" in out and "writing one WAV file per request" in out



def test_device_dying_mid_request_completes_it_to_wav(tiny_ckpt, tmp_path, start_daemon, service_pipeline):
    alsa = alsa_home(tmp_path / "home", tmp_path / "played.raw")
    d = start_daemon(service_config(tiny_ckpt, tmp_path, audio={"output": "device"}), alsa=alsa)
    text, seed = "The speaker is unplugged while I talk.", 31
    want = expected_pcm(service_pipeline, text, seed)
    assert len(want) > 24000, "need at least a second of audio to cut the device mid-way"
    c = d.connect()
    c.send({"type": "speak", "text": text, "seed": seed, "id": "unplugged"})
    c.events(("started",))
    wait_for(lambda: np.count_nonzero(alsa.read()), 30, "the request is being heard")   # ...
    assert alsa.pacers()
    alsa.unplug()                           # ... when the "card" goes away
    (done,) = [e for e in c.events(("done", "error")) if e["type"] in ("done", "error")]
    c.close()
    assert done["type"] == "done" and done["output"] == str(d.wav_dir / "unplugged.wav"), done
    got, rate = read_wav(done["output"])
    assert rate == 24000 and len(got) == len(want)           # the whole request, not the rest of it
    assert np.abs(got - np.clip(want, -1, 1)).max() <= 1 / 32767 + 1e-6
    (st,) = d.request({"type": "status"})
    main = st["channels"]["main"]
    assert main["ok"] is False and main["error"] and main["output"] == "wav (device failed)"
    evs = d.request({"type": "speak", "text": "Next one goes to a file.", "seed": 32, "id": "after"})
    assert evs[-1]["type"] == "done" and evs[-1]["output"].endswith("after.wav"), evs
    assert "failed" in d.log()


_BACKPRESSURE = """
import sys, time, threading
import numpy as np
from pathlib import Path
import appliance.audio.device as sound_device
import appliance.audio.feed as voice_feed
from appliance.audio.request import RequestAudio
voice_feed.MAX_BUFFER_S = 0.5                  # a small FIFO so that the writer must wait
dev = sound_device.DeviceOutput(None, 24000, 50.0)
dev.open()
beats = []
ra = RequestAudio("bp", Path(sys.argv[1]), dev, beat=lambda: beats.append(time.monotonic()))
done = threading.Event()
t0 = time.monotonic()
for _ in range(20):                            # 20 x 0.25 s = 5 s of audio
    ra.write(np.full(6000, 0.25, np.float32))
t_write = time.monotonic() - t0
ra.finish(lambda out: done.set())
assert done.wait(10)
dev.close(5)
print("RESULT", round(t_write, 2), len(beats), dev.status()["underruns"])
"""


def test_device_fifo_back_pressure_keeps_the_heartbeat(tmp_path):
    alsa = alsa_home(tmp_path / "home", tmp_path / "played.raw", rate=24000)
    r = subprocess.run([sys.executable, "-c", _BACKPRESSURE, str(tmp_path / "bp.wav")], cwd=str(ROOT),
                       env={**os.environ, "HOME": str(alsa.home)}, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    t_write, beats, underruns = r.stdout.split("RESULT")[1].split()
    # the writer was held back by playback: 5 s of audio into the 0.5 s FIFO, PortAudio's and ALSA's
    # buffers and the pacer's pipe (about 1.3 s together: with 2.5 s of audio it once waited only 1.2 s)
    assert float(t_write) >= 1.5
    assert int(beats) >= 10                 # ... and kept beating while it waited
    wait_for(lambda: np.count_nonzero(alsa.read() == np.float32(0.25)) >= 20 * 6000, 10,
             "the pacer flushing its pipe into the file")
    assert np.count_nonzero(alsa.read() == np.float32(0.25)) == 20 * 6000     # every sample played once
