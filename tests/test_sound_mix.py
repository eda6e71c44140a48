"""The mixer's start threshold and re-buffering: a streaming voice starts only with a whole device
wake-up queued, so a first chunk shorter than PortAudio's block is not played as chunk + silence
+ chunk (an underrun inside the first word); a voice that runs dry mid-stream is an underrun,
counted with the silence it leaves, and resumes only with a re-buffer's worth queued."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from appliance.audio.mix import Lanes


def _mix(lanes: Lanes, frames: int, **kw):
    out = np.full(frames, 9.0, np.float32)
    sounding, underruns, gap, taken, _held = lanes.mix(out, frames, played_at=0.0, played=[], **kw)
    return out, sounding, underruns, gap, taken


def test_a_first_chunk_shorter_than_a_block_waits_for_the_next_instead_of_running_dry():
    lanes = Lanes()
    lanes.begin("r", "main", lambda reason: None)
    lanes.push("r", np.full(300, 0.5, np.float32), None)      # first chunk: 300 samples, block 512
    out, *counts = _mix(lanes, 512)
    assert counts == [0, 0, 0, 0]                             # waits: no gap, no underrun
    lanes.push("r", np.full(300, 0.25, np.float32), None)     # second chunk arrives
    out, *counts = _mix(lanes, 512)
    assert counts == [1, 0, 0, 512]
    assert np.all(out[:300] == 0.5) and np.all(out[300:512] == 0.25)   # contiguous speech
    out, *counts = _mix(lanes, 512)                           # started: now running short is an underrun
    assert counts == [1, 1, 512 - 88, 88]
    assert np.all(out[88:] == 0.0)


def test_an_ended_voice_shorter_than_a_block_plays_at_once():
    lanes = Lanes()
    lanes.begin("r", "main", lambda reason: None)
    lanes.push("r", np.full(100, 0.5, np.float32), None)
    lanes.end("r")
    out, *counts = _mix(lanes, 512)
    assert counts == [1, 0, 0, 100]
    assert np.all(out[:100] == 0.5) and np.all(out[100:] == 0.0)


def test_a_waiting_voice_does_not_hold_back_another_channel():
    lanes = Lanes()
    lanes.begin("a", "ch-a", lambda reason: None)
    lanes.begin("b", "ch-b", lambda reason: None)
    lanes.push("a", np.full(100, 0.5, np.float32), None)      # below the threshold
    lanes.push("b", np.full(600, 0.25, np.float32), None)
    out, *counts = _mix(lanes, 512)
    assert counts == [1, 0, 0, 512]
    assert np.all(out == 0.25)


def test_the_start_threshold_covers_a_whole_device_wake_up():
    lanes = Lanes()
    lanes.begin("r", "main", lambda reason: None)
    lanes.push("r", np.full(600, 0.5, np.float32), None)      # more than a block, less than a burst
    assert _mix(lanes, 512, start_frames=1024)[1] == 0
    lanes.push("r", np.full(600, 0.5, np.float32), None)
    assert _mix(lanes, 512, start_frames=1024)[1:3] == (1, 0)


def test_a_stalled_voice_pauses_once_until_it_has_re_buffered_and_the_gap_is_counted():
    lanes = Lanes()
    lanes.begin("r", "main", lambda reason: None)
    lanes.push("r", np.full(512, 0.5, np.float32), None)
    assert _mix(lanes, 512, rebuffer_frames=2048)[1:] == (1, 0, 0, 512)
    assert _mix(lanes, 512, rebuffer_frames=2048)[1:] == (0, 1, 512, 0)       # dry: one underrun
    for _ in range(3):                                         # chunks trickle in below the re-buffer
        lanes.push("r", np.full(512, 0.5, np.float32), None)
        assert _mix(lanes, 512, rebuffer_frames=2048)[1:] == (0, 0, 512, 0)   # paused, silence counted
    lanes.push("r", np.full(512, 0.5, np.float32), None)      # 2048 queued: resumes
    out, *counts = _mix(lanes, 512, rebuffer_frames=2048)
    assert counts == [1, 0, 0, 512] and np.all(out == 0.5)
    lanes.end("r")                                             # an ended voice drains without underruns
    for _ in range(3):
        assert _mix(lanes, 512, rebuffer_frames=2048)[2] == 0


def _cabin(order_fn):
    """A device (its real lanes and callback; no PortAudio stream) with three requests of one
    channel: c1 sounding and still being synthesized, q1 synthesized and waiting, q2 being
    synthesized behind it; each request's samples carry its own value. ``order_fn(audios)``
    aborts them, with a device callback run after every step of every abort (as a loaded machine
    may schedule it). Returns the values played after the cancel began and the underruns."""
    from types import SimpleNamespace

    from appliance.audio.device import DeviceOutput
    from appliance.audio.request import RequestAudio

    dev = DeviceOutput(None, 24000, 50.0)
    dev.ok, dev.error, dev.rate = True, None, 24000
    heard: list[float] = []

    def callback():
        out = np.zeros((256, 1), np.float32)
        dev._callback(out, 256, None, SimpleNamespace(output_underflow=False))
        heard.extend(np.unique(out[out != 0]).tolist())

    ras = {rid: RequestAudio(rid, Path("/nonexistent") / f"{rid}.wav", dev, lane="cabin") for rid in ("c1", "q1", "q2")}
    for rid, v in (("c1", 0.1), ("q1", 0.2), ("q2", 0.3)):
        ras[rid].write(np.full(4800, v, np.float32))
    ras["q1"].finish(lambda output: None)
    callback()
    assert heard == [np.float32(0.1)]                  # c1 sounds, the others wait behind it
    heard.clear()
    for name in ("drop", "forget"):
        orig = getattr(dev, name)
        setattr(dev, name, lambda owner, orig=orig: (orig(owner), callback())[0])
    order_fn(list(ras.values()))
    return heard, dev.underruns


def test_a_cancel_by_channel_never_lets_a_cancelled_waiting_request_sound():
    """Aborting a channel's requests: the one sounding must go last, else the next (cancelled
    too) sounds until its own abort (the cause of a flaky cancel test on a loaded machine)."""
    from appliance.audio.cancel import abort_all

    heard, underruns = _cabin(abort_all)
    assert set(heard) <= {np.float32(0.1)} and underruns == 0, (heard, underruns)
    # each also sent to its client (wyoming.play): the order comes from the box's voice
    from appliance.audio.request import ClientOnlyAudio
    from appliance.audio.sink import TeeAudio

    heard, underruns = _cabin(lambda audios: abort_all([TeeAudio(a, ClientOnlyAudio()) for a in audios]))
    assert set(heard) <= {np.float32(0.1)} and underruns == 0, (heard, underruns)
    # the order this replaces (request order, one by one): q1 sounds between two aborts
    heard, _ = _cabin(lambda audios: [a.abort() for a in audios])
    assert np.float32(0.2) in heard


def test_a_held_voice_starts_with_its_hold_queued_or_when_its_request_ends():
    """The start policy's hold (slack for a hiccup, more where synthesis cannot keep up): the voice
    waits for one wake-up plus the hold, not just the wake-up; an ended request plays at once;
    after its start the hold plays no part (re-buffering has its own rule)."""
    lanes = Lanes()
    lanes.begin("r", "main", lambda reason: None)
    lanes.hold("r", 1000)
    lanes.push("r", np.full(1500, 0.5, np.float32), None)     # a wake-up (1024) but not the hold
    assert _mix(lanes, 512, start_frames=1024)[1:] == (0, 0, 0, 0)
    lanes.push("r", np.full(600, 0.5, np.float32), None)      # 2100 >= 1024 + 1000
    assert _mix(lanes, 512, start_frames=1024)[1:] == (1, 0, 0, 512)
    lanes.begin("e", "other", lambda reason: None)
    lanes.hold("e", 10 ** 6)
    lanes.push("e", np.full(100, 0.25, np.float32), None)
    assert _mix(lanes, 512, start_frames=1024)[1] == 1        # "e" still waits: only "r" sounds
    lanes.end("e")
    out, sounding, *_ = _mix(lanes, 512, start_frames=1024)
    assert sounding == 2 and np.count_nonzero(out == 0.75) == 100   # "e" ended: it plays what it has


def test_each_channel_plays_at_its_volume_read_at_every_block_and_a_raised_voice_is_clipped():
    """The gain is looked up per voice and block (a reload's new Volume is heard at the next
    block, also for audio queued before), per channel also when serializing, and a voice raised
    above 0 dB never leaves [-1, 1]."""
    from appliance.audio.volume import Volume, db_to_gain

    vol = {"v": Volume(-6.0, {"main": 0.0, "alert": 6.0})}
    lanes = Lanes(serialize=True, gain=lambda ch: vol["v"].gain(ch))
    lanes.begin("a", "main", lambda reason: None)
    lanes.push("a", np.full(1024, 0.5, np.float32), None)
    lanes.end("a")
    out, *_ = _mix(lanes, 512)
    assert np.allclose(out, 0.5 * db_to_gain(-6.0)) and abs(db_to_gain(-6.0) - 0.501) < 1e-3
    vol["v"] = Volume(-20.0, {"main": 0.0})                  # a reload: the queued rest is quieter
    out, *_ = _mix(lanes, 512)
    assert np.allclose(out, 0.05)
    lanes.forget("a")
    vol["v"] = Volume(0.0, {"alert": 12.0})
    lanes.begin("b", "alert", lambda reason: None)
    lanes.push("b", np.full(512, 0.5, np.float32), None)
    lanes.end("b")
    out, *_ = _mix(lanes, 512)
    assert np.all(out == 1.0)                                # 0.5 x 3.98, clipped


def test_played_waits_for_the_latency_the_device_reports_and_preroll_comes_first():
    """The device's callback (PortAudio's timestamps as a sink that buffers 250 ms reports them):
    a chunk counts as played only once that delay has passed, not PortAudio's 50 ms; after a
    (re)open, ``preroll_ms`` of silence go out before any voice."""
    from types import SimpleNamespace

    from appliance.audio.device import DeviceOutput

    dev = DeviceOutput(None, 24000, 50.0, preroll_ms=20.0)
    dev.ok, dev.rate, dev._preroll = True, 24000, round(0.02 * 24000)
    owner = object()
    dev.begin(owner, lambda reason: None)
    played = []
    dev.enqueue(owner, np.full(2400, 0.5, np.float32), on_played=lambda: played.append(1))
    dev.end(owner)
    out = np.ones((240, 1), np.float32)
    status = SimpleNamespace(output_underflow=False)
    t = SimpleNamespace(currentTime=100.0, outputBufferDacTime=100.25)
    blocks = []
    while not dev._played:
        dev._callback(out, 240, t, status)
        blocks.append(out[:, 0].copy())
    assert not blocks[0].any() and not blocks[1].any(), "the pre-roll (20 ms = 2 blocks) is silence"
    assert blocks[2].max() == 0.5
    due, _ = dev._played[0]
    assert due - time.monotonic() > 0.2, "played 250 ms after the last block, as the device reports"


def test_done_names_the_device_a_waiting_request_played_on_not_the_one_it_began_on(tmp_path):
    """A request that waited for its device (``on_device_error: wait``) is played on the device as
    it was found again: a speaker back under another card index has another name."""
    from appliance.audio.device import DeviceOutput
    from appliance.audio.request import RequestAudio

    dev = DeviceOutput("USB", 24000, 50.0)
    dev.ok, dev.rate, dev.name = True, 24000, "USB Audio: - (hw:1,0)"
    ra = RequestAudio("w", tmp_path / "w.wav", dev, on_device_error="wait", wait_from_start=True)
    ra.write(np.full(480, 0.25, np.float32))
    outputs = []
    ra.finish(outputs.append)
    dev.name = "USB Audio: - (hw:2,0)"           # re-found under card 2
    assert ra.replay()
    ra._played()                                 # (the device's watcher, once it played out)
    assert outputs == ["device:USB Audio: - (hw:2,0)"]
