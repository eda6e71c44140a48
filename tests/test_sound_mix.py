"""The mixer's start threshold and re-buffering: a streaming voice starts only with a whole device
wake-up queued, so a first chunk shorter than PortAudio's block is not played as chunk + silence
+ chunk (an underrun inside the first word); a voice that runs dry mid-stream is an underrun,
counted with the silence it leaves, and resumes only with a re-buffer's worth queued."""

from __future__ import annotations

import numpy as np

from appliance.audio.mix import Lanes


def _mix(lanes: Lanes, frames: int, **kw):
    out = np.full(frames, 9.0, np.float32)
    sounding, underruns, gap, taken = lanes.mix(out, frames, played_at=0.0, played=[], **kw)
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
