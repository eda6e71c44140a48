"""The start policy's sentence-boundary rule, as a unit: when the CPU is really gone (decode steps
over BUSY x this box's best at the same rows) a later sentence holds until it is queued whole, a
sentence already playing re-buffers its whole rest, a starting request plans for its first
sentence alone, and ``done.pauses`` says so; on a box that is merely slow the plan's finite holds
stay. The engine, request and voice are stand-ins recording what the policy asks of them (the
real ones are exercised through the daemon in tests/test_service_start.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from appliance.audio.mix import Pause
from appliance.service.startpolicy import WHOLE_S, StartPolicy
from appliance.synth.schedule import ChunkSchedule

RATE = 44100


class _Device:
    rate = RATE

    def __init__(self) -> None:
        self.holds: list[float] = []

    def hold(self, voice, seconds: float) -> None:
        self.holds.append(seconds)


class _Voice:
    def __init__(self) -> None:
        self.device = _Device()
        self.rebuffers: list[float] = []
        self.pauses: list[Pause] = []

    def rebuffer(self, seconds: float) -> None:
        self.rebuffers.append(seconds)

    def end_sentence_next(self) -> None:
        pass


class _Item(SimpleNamespace):
    __hash__ = object.__hash__      # the policy keys its decisions by request object
    __eq__ = object.__eq__


def _setup(sentences: int = 3, tokens: int = 20):
    task = SimpleNamespace(sentences=[SimpleNamespace(text_tokens=tokens) for _ in range(sentences)],
                           chunk_scale=1, decoded=lambda k: 0,
                           report=SimpleNamespace(stats=None, text_tokens=[tokens] * sentences))
    eng = SimpleNamespace(schedule=ChunkSchedule(first=4, cap=48), step_s=0.010, window_s=0.004,
                          tasks=[task], lookahead_of=lambda t: 14)
    voice = _Voice()
    item = _Item(id="r1", channel="a", task=task, first_pcm_at=None, resume_from=0,
                           job=SimpleNamespace(params=SimpleNamespace(min_new_tokens=0, max_new_tokens=2048)),
                           audio=SimpleNamespace(voice=voice, first_out_at=None))
    return StartPolicy(eng, slack_s=0.1), eng, item, voice


def _chunk(sentence: int) -> SimpleNamespace:
    return SimpleNamespace(sentence=sentence, ends_sentence=False)


def test_cpu_gone_holds_the_next_sentence_whole_and_says_so():
    pol, eng, item, voice = _setup()
    pol.on_chunk(item, _chunk(0))                 # quiet: 10 ms steps keep up, the start holds the slack only
    assert voice.device.holds == [pytest.approx(0.1)]
    eng.step_s = 0.040                            # a neighbour took the cores: 4x the best step
    pol.on_chunk(item, _chunk(0))                 # mid-sentence: a dry-out would wait for the whole rest
    assert voice.rebuffers[-1] == WHOLE_S
    pol.on_chunk(item, _chunk(1))                 # the next sentence's first chunk: held until queued whole
    assert voice.device.holds[-1] == WHOLE_S
    voice.pauses.append(Pause(1, 3 * RATE, RATE // 2, True))
    pauses = pol.fields(item)["pauses"]
    assert pauses == [{"sentence": 1, "at_s": 3.0, "ms": 500.0, "where": "sentence_boundary", "cause": "cpu_busy",
                       "whole_sentence": True}]


def test_a_merely_slow_box_keeps_the_finite_plan():
    pol, eng, item, voice = _setup()
    eng.step_s = 0.040                            # slow from the start: its own best, not a busy CPU
    pol.on_chunk(item, _chunk(0))
    pol.on_chunk(item, _chunk(1))
    assert 0.1 < voice.device.holds[-1] < WHOLE_S
    assert 0 < voice.rebuffers[-1] < WHOLE_S
    voice.pauses.append(Pause(1, RATE, RATE // 4, True))
    assert "whole_sentence" not in pol.fields(item)["pauses"][0]


def test_a_request_starting_while_the_cpu_is_gone_plans_for_its_first_sentence():
    pol, eng, item, voice = _setup(sentences=3)
    pol.on_chunk(item, _chunk(0))                 # learns the best step (10 ms)
    pol.fields(item)
    eng.step_s = 0.040
    _, _, item2, voice2 = _setup(sentences=3)
    pol.on_chunk(item2, _chunk(0))
    one = _Item(**{**vars(item2), "audio": SimpleNamespace(voice=_Voice(), first_out_at=None)})
    one.task = SimpleNamespace(**{**vars(item2.task), "sentences": item2.task.sentences[:1]})
    pol.apply(one)                                # the same request with one sentence: the same start hold
    assert voice2.device.holds[0] == pytest.approx(one.audio.voice.device.holds[0])
    slow = StartPolicy(eng, slack_s=0.1)          # a box never faster than this: the whole request's plan
    _, _, item3, voice3 = _setup(sentences=3)
    slow.on_chunk(item3, _chunk(0))
    assert voice3.device.holds[0] > voice2.device.holds[0] + 0.5
