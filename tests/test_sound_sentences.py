"""A voice pauses at a sentence boundary, not inside a sentence: where the next sentence is not far
enough along (its hold, decided by the start policy), the voice holds after the last chunk of
the sentence before it; the silence is recorded as a pause at the boundary, not as an underrun.
Running dry inside a sentence is still an underrun, and re-buffers the amount set for it."""

from __future__ import annotations

import numpy as np

from appliance.audio.mix import Lanes, Pause

BLOCK = 512


def _mix(lanes: Lanes, **kw):
    out = np.full(BLOCK, 9.0, np.float32)
    counts = lanes.mix(out, BLOCK, played_at=0.0, played=[], **kw)
    return out, counts


def _voice(pauses: list) -> Lanes:
    lanes = Lanes()
    lanes.begin("r", "main", lambda reason: None, pauses=pauses)
    return lanes


def test_a_voice_holds_at_the_sentence_boundary_until_the_next_sentence_has_its_hold_queued():
    pauses: list[Pause] = []
    lanes = _voice(pauses)
    lanes.push("r", np.full(1024, 0.5, np.float32), None)
    lanes.end_sentence_next("r")
    lanes.push("r", np.full(256, 0.5, np.float32), None)          # the first sentence ends here (1280)
    out, c = _mix(lanes)
    assert c == (1, 0, 0, 512, 0)
    lanes.hold("r", 1000)                                          # sentence 1 must hold 1000 beyond a block
    lanes.push("r", np.full(600, 0.25, np.float32), None)          # its first chunk
    out, c = _mix(lanes)
    assert c == (1, 0, 0, 512, 0)
    out, c = _mix(lanes)                                           # 256 left of sentence 0, then the boundary
    assert c == (1, 0, 256, 256, 1)                                # held there: no underrun, 256 of silence
    assert np.all(out[:256] == 0.5) and np.all(out[256:] == 0.0)
    assert pauses == [Pause(sentence=1, at=1280, samples=256, at_boundary=True)]
    lanes.push("r", np.full(600, 0.25, np.float32), None)          # 1200 queued < 512 + 1000: still held
    out, c = _mix(lanes)
    assert c == (0, 0, 512, 0, 0) and pauses[0].samples == 768
    lanes.push("r", np.full(400, 0.25, np.float32), None)          # 1600 >= 1512: it plays on
    out, c = _mix(lanes)
    assert c == (1, 0, 0, 512, 0) and np.all(out == 0.25)
    assert len(pauses) == 1 and pauses[0].samples == 768


def test_a_next_sentence_far_enough_along_plays_on_without_a_pause():
    pauses: list[Pause] = []
    lanes = _voice(pauses)
    lanes.end_sentence_next("r")
    lanes.push("r", np.full(700, 0.5, np.float32), None)           # a whole (short) sentence
    lanes.hold("r", 0)                                             # its start hold
    _mix(lanes)
    lanes.hold("r", 300)                                           # the next one's hold, at the boundary
    lanes.push("r", np.full(1000, 0.25, np.float32), None)
    out, c = _mix(lanes)                                           # 188 left, then 1000 queued >= 512 + 300
    assert c == (1, 0, 0, 512, 0) and np.all(out[:188] == 0.5) and np.all(out[188:] == 0.25)
    assert pauses == []


def test_a_boundary_reached_before_the_next_sentence_is_decided_is_a_pause_not_an_underrun():
    """The player outran synthesis exactly at a sentence's end (the next sentence's prompt and
    look-ahead take longer than the audio queued): a pause at the boundary, resumed with the
    hold decided at the next sentence's first chunk."""
    pauses: list[Pause] = []
    lanes = _voice(pauses)
    lanes.end_sentence_next("r")
    lanes.push("r", np.full(800, 0.5, np.float32), None)
    _mix(lanes)
    out, c = _mix(lanes)
    assert c == (1, 0, 224, 288, 1)                                # 288 played, the rest held
    out, c = _mix(lanes)
    assert c == (0, 0, 512, 0, 0)                                  # nothing decided, nothing queued
    lanes.hold("r", 600)                                           # the next sentence's decision ...
    lanes.push("r", np.full(700, 0.25, np.float32), None)          # ... and its first chunk
    assert _mix(lanes)[1] == (0, 0, 512, 0, 0)                     # 700 < 512 + 600
    lanes.push("r", np.full(700, 0.25, np.float32), None)
    assert _mix(lanes)[1] == (1, 0, 0, 512, 0)
    assert pauses == [Pause(sentence=1, at=800, samples=224 + 512 + 512, at_boundary=True)]


def test_running_dry_inside_a_sentence_is_an_underrun_that_re_buffers_what_was_set():
    pauses: list[Pause] = []
    lanes = _voice(pauses)
    lanes.push("r", np.full(512, 0.5, np.float32), None)
    lanes.rebuffer("r", 1500)
    _mix(lanes, rebuffer_frames=100)
    out, c = _mix(lanes, rebuffer_frames=100)
    assert c == (0, 1, 512, 0, 0)                                  # dry mid-sentence: an underrun
    for _ in range(2):
        lanes.push("r", np.full(512, 0.5, np.float32), None)
        assert _mix(lanes, rebuffer_frames=100)[1] == (0, 0, 512, 0, 0)   # 1024 < 1500: re-buffering
    lanes.push("r", np.full(512, 0.5, np.float32), None)
    assert _mix(lanes, rebuffer_frames=100)[1] == (1, 0, 0, 512, 0)
    assert pauses == [Pause(sentence=0, at=512, samples=3 * 512, at_boundary=False)]


def test_an_ended_request_never_holds_at_its_last_boundary():
    pauses: list[Pause] = []
    lanes = _voice(pauses)
    lanes.end_sentence_next("r")
    lanes.push("r", np.full(600, 0.5, np.float32), None)
    lanes.end("r")
    out, c = _mix(lanes)
    assert c == (1, 0, 0, 512, 0)
    out, c = _mix(lanes)
    assert c == (1, 0, 0, 88, 0) and pauses == []


def test_a_next_sentence_queued_whole_plays_on_whatever_its_hold():
    """A hold larger than the sentence itself (a box far behind): once the whole sentence is
    queued, nothing of it can run dry, and it plays."""
    pauses: list[Pause] = []
    lanes = _voice(pauses)
    lanes.end_sentence_next("r")
    lanes.push("r", np.full(512, 0.5, np.float32), None)
    _mix(lanes)
    lanes.hold("r", 10_000)                                        # paused at the boundary, a large hold
    lanes.push("r", np.full(600, 0.25, np.float32), None)
    assert _mix(lanes)[1] == (0, 0, 512, 0, 0)
    lanes.end_sentence_next("r")
    lanes.push("r", np.full(600, 0.25, np.float32), None)          # the sentence's last chunk: all of it queued
    out, c = _mix(lanes)
    assert c == (1, 0, 0, 512, 0) and np.all(out == 0.25)
    assert pauses == [Pause(sentence=1, at=512, samples=512, at_boundary=True)]
