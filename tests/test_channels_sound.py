"""Two channels on ONE sound device (a paced ALSA file device at 24000 Hz, so samples pass
unchanged): ``audio.same_device: mix`` sums the channels' current requests and clips, requests of
one channel never overlap; ``serialize`` plays whole requests one after another in start order.
Constant-valued "requests" make every played sample tell which voices sounded in it."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from tests.fixtures_service import ROOT, alsa_home

_SCRIPT = """
import sys, threading
import numpy as np
from pathlib import Path
from appliance.audio.device import DeviceOutput
from appliance.audio.request import RequestAudio
dev = DeviceOutput(None, 24000, 50.0, mode=sys.argv[2])
dev.open()
tmp = Path(sys.argv[1])
# x1, x2 on channel x (one after the other), y1 on channel y
voices = [("x1", "x", 0.75, 12000), ("y1", "y", 0.5, 12000), ("x2", "x", 0.125, 6000)]
ras = {n: RequestAudio(n, tmp / (n + ".wav"), dev, lane=lane) for n, lane, _, _ in voices}
done = {n: threading.Event() for n in ras}
for n, lane, v, k in voices:
    for _ in range(4):
        ras[n].write(np.full(k // 4, v, np.float32))
for n in ras:
    ras[n].finish(lambda out, n=n: done[n].set())
assert all(e.wait(15) for e in done.values())
print("RESULT", dev.mixed_blocks, dev.status()["voices"])
dev.close(5)
"""


def _play(tmp_path, mode):
    alsa = alsa_home(tmp_path / mode, tmp_path / f"{mode}.raw", rate=24000)
    r = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path), mode], cwd=str(ROOT),
                       env={**os.environ, "HOME": str(alsa.home)}, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    mixed, voices = map(int, r.stdout.split("RESULT")[1].split())
    p = alsa.read()
    return p[p != 0], mixed, voices


def test_same_device_mix_sums_channels_and_clips(tmp_path):
    p, mixed, voices = _play(tmp_path, "mix")
    n = {v: int(np.count_nonzero(p == np.float32(v))) for v in (1.0, 0.75, 0.5, 0.625, 0.125)}
    assert len(p) == sum(n.values()), "a sample that is no sum of the voices sounding (garbage)"
    assert n[1.0] > 0 and mixed > 0                        # x1 + y1 = 1.25 sounded together, clipped
    assert n[1.0] + n[0.75] == 12000                       # every sample of x1 once
    assert n[1.0] + n[0.5] + n[0.625] == 12000             # every sample of y1 once
    assert n[0.625] + n[0.125] == 6000                     # x2 after x1 (never 0.875 = x1 + x2)
    assert voices == 0


def test_same_device_serialize_plays_requests_whole_in_start_order(tmp_path):
    p, mixed, voices = _play(tmp_path, "serialize")
    want = np.concatenate([np.full(12000, 0.75), np.full(12000, 0.5), np.full(6000, 0.125)]).astype(np.float32)
    assert mixed == 0 and len(p) == len(want) and np.array_equal(p, want)


@pytest.mark.parametrize("bad", ["mixx"])
def test_same_device_policy_is_validated(bad):
    from appliance.config import config_from_dict
    from appliance.errors import ConfigError

    with pytest.raises(ConfigError, match="audio.same_device"):
        config_from_dict({"audio": {"same_device": bad}})
