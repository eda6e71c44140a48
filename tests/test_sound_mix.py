"""The mixer's start threshold: a streaming voice starts only with a whole device block queued,
so a first chunk shorter than PortAudio's block is not played as chunk + silence + chunk (an
underrun inside the first word); mid-stream a dry voice is still an underrun."""

from __future__ import annotations

import numpy as np

from appliance.service.sound_mix import Lanes


def _mix(lanes: Lanes, frames: int):
    out = np.full(frames, 9.0, np.float32)
    played: list = []
    sounding, dry, taken = lanes.mix(out, frames, played_at=0.0, played=played)
    return out, sounding, dry, taken


def test_a_first_chunk_shorter_than_a_block_waits_for_the_next_instead_of_running_dry():
    lanes = Lanes()
    lanes.begin("r", "main", lambda reason: None)
    lanes.push("r", np.full(300, 0.5, np.float32), None)      # first chunk: 300 samples, block 512
    out, sounding, dry, taken = _mix(lanes, 512)
    assert (sounding, dry, taken) == (0, False, 0)            # waits: no gap, no underrun
    lanes.push("r", np.full(300, 0.25, np.float32), None)     # second chunk arrives
    out, sounding, dry, taken = _mix(lanes, 512)
    assert (sounding, dry, taken) == (1, False, 512)
    assert np.all(out[:300] == 0.5) and np.all(out[300:512] == 0.25)   # contiguous speech
    out, sounding, dry, taken = _mix(lanes, 512)              # started: now running short is an underrun
    assert (sounding, dry, taken) == (1, True, 88)
    assert np.all(out[88:] == 0.0)


def test_an_ended_voice_shorter_than_a_block_plays_at_once():
    lanes = Lanes()
    lanes.begin("r", "main", lambda reason: None)
    lanes.push("r", np.full(100, 0.5, np.float32), None)
    lanes.end("r")
    out, sounding, dry, taken = _mix(lanes, 512)
    assert (sounding, dry, taken) == (1, False, 100)
    assert np.all(out[:100] == 0.5) and np.all(out[100:] == 0.0)


def test_a_waiting_voice_does_not_hold_back_another_channel():
    lanes = Lanes()
    lanes.begin("a", "ch-a", lambda reason: None)
    lanes.begin("b", "ch-b", lambda reason: None)
    lanes.push("a", np.full(100, 0.5, np.float32), None)      # below the threshold
    lanes.push("b", np.full(600, 0.25, np.float32), None)
    out, sounding, dry, taken = _mix(lanes, 512)
    assert (sounding, dry, taken) == (1, False, 512)
    assert np.all(out == 0.25)


def test_the_start_threshold_covers_a_whole_device_wake_up():
    lanes = Lanes()
    lanes.begin("r", "main", lambda reason: None)
    lanes.push("r", np.full(600, 0.5, np.float32), None)      # more than a block, less than a burst
    out = np.zeros(512, np.float32)
    assert lanes.mix(out, 512, 0.0, [], start_frames=1024)[0] == 0
    lanes.push("r", np.full(600, 0.5, np.float32), None)
    assert lanes.mix(out, 512, 0.0, [], start_frames=1024)[:2] == (1, False)
