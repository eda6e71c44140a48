"""Priorities as a listener hears them, through the real daemon on a paced ALSA file device: an
answer interrupted by an alert resumes right after it from the interrupted sentence (before an
answer queued earlier), background speech waits for a later normal request, and a cancel by
channel hits what its scope names (``current``, ``queue``: alerts kept, ``all``)."""

from __future__ import annotations

import numpy as np

from appliance.core import SynthesisRequest, SynthParams
from appliance.messages.protocol import Speak
from appliance.service.request import Request, State
from appliance.service.scheduler import Scheduler
from tests.fixtures_service import DEFAULT_RATE, resample_like_daemon, service_config
from tests.test_channels_service import assert_close, find_close, heard, speech, wait_len
from tests.waits import wait_for

ANSWER = "First part of the answer. Second part comes now. Third and last part."


def _chunks(pipe, text: str, seed: int, **params) -> list:
    job = pipe.prepare(SynthesisRequest(text=text, id="want", seed=seed, params=SynthParams(**params)))
    return job, list(pipe.run(job))


def _at_device(chunks, first_sentence: int = 0) -> np.ndarray:
    pcm = np.concatenate([c.samples for c in chunks if c.sentence >= first_sentence])
    return speech(resample_like_daemon(pcm, DEFAULT_RATE))


def test_interrupted_answer_resumes_right_after_the_alert_from_its_sentence(
        tiny_ckpt, tmp_path, start_daemon, service_pipeline, alsa_file):
    d = start_daemon(service_config(tiny_ckpt, tmp_path, audio={"output": "device"}), alsa=alsa_file)
    p = dict(min_new_tokens=60, max_new_tokens=60)          # ~1.3 s per sentence
    short = dict(min_new_tokens=40, max_new_tokens=40)
    job, chunks = _chunks(service_pipeline, ANSWER, 80, **p)
    assert len(job.sentences) == 3
    whole, first = _at_device(chunks), _at_device([c for c in chunks if c.sentence == 0])
    c = d.connect()
    c.send({"type": "speak", "text": ANSWER, "seed": 80, "id": "n1", "params": p})
    c.send({"type": "speak", "text": "A later answer.", "seed": 81, "id": "n2", "params": short})
    # the second sentence is being heard when the alert comes
    wait_for(lambda: heard(alsa_file) >= len(first) + 0.3 * DEFAULT_RATE, 60, "the second sentence heard")
    c.send({"type": "speak", "text": "Alarm!", "seed": 82, "id": "a1", "priority": "alert", "params": short})
    evs, ends = c.events_until_ids({"n1", "n2", "a1"})
    c.close()
    assert all(e["type"] == "done" for e in ends.values()), ends
    order = [(e["id"], e["type"]) for e in evs if e["type"] in ("started", "preempted", "done")]
    n1 = [t for i, t in order if i == "n1"]
    assert n1 == ["started", "preempted", "started", "done"], order
    # right after the alert: n1 starts again after a1 (its audio queues behind a1's in the channel's
    # lane) and before the answer queued earlier, which the alert interrupted too
    last = lambda ev: len(order) - 1 - order[::-1].index(ev)       # noqa: E731
    assert order.index(("a1", "started")) < last(("n1", "started")) < last(("n2", "started")), order
    assert order.index(("a1", "done")) < order.index(("n1", "done")) < order.index(("n2", "done")), order
    assert ends["n1"]["spoken"] == [s.text for s in job.sentences], ends["n1"]
    assert "n1 resumes on main right after a1 (from sentence 1)" in d.log()     # from its second sentence
    # what the device played: n1 to the alert, the alert, n1 from its second sentence, then n2
    alarm = speech(resample_like_daemon(np.concatenate([x.samples for x in _chunks(service_pipeline, "Alarm!", 82, **short)[1]]), DEFAULT_RATE))
    rest = _at_device(chunks, 1)
    got = wait_len(alsa_file, len(rest) + len(alarm) + len(first))
    k = find_close(got, alarm)
    assert k is not None and len(first) < k < len(whole), "the alert did not come in the second sentence"
    assert_close(got[:k], whole[:k], "n1 up to the alert")
    assert_close(got[k:k + len(alarm)], alarm, "the alert")
    got = wait_len(alsa_file, k + len(alarm) + len(rest))
    assert_close(got[k + len(alarm):k + len(alarm) + len(rest)], rest, "n1 again from its second sentence")


def test_background_waits_for_a_later_normal_request(tiny_ckpt, tmp_path, start_daemon, alsa_file):
    d = start_daemon(service_config(tiny_ckpt, tmp_path, audio={"output": "device"}), alsa=alsa_file)
    c = d.connect()
    c.send({"type": "speak", "text": "Background music talk.", "seed": 90, "id": "bg", "priority": "background",
            "params": {"min_new_tokens": 150, "max_new_tokens": 150}})
    wait_for(lambda: heard(alsa_file) >= 0.3 * DEFAULT_RATE, 60, "the background request heard")
    c.send({"type": "speak", "text": "Normal news.", "seed": 91, "id": "n", "params": {"max_new_tokens": 40}})
    evs, ends = c.events_until_ids({"bg", "n"})
    c.close()
    assert all(e["type"] == "done" for e in ends.values()), ends
    order = [(e["id"], e["type"]) for e in evs if e["type"] in ("started", "preempted", "done")]
    assert [t for i, t in order if i == "bg"] == ["started", "preempted", "started", "done"], order
    pre = next(e for e in evs if e["type"] == "preempted")
    assert pre["by"] == "n" and pre["action"] == "resume"
    assert order.index(("n", "done")) < order.index(("bg", "done")), order
    assert "normal n preempts bg (background" in d.log()


def test_cancel_scope_current_then_all(tiny_ckpt, tmp_path, start_daemon, alsa_file):
    d = start_daemon(service_config(tiny_ckpt, tmp_path, audio={"output": "device"}), alsa=alsa_file)
    alsa_file.set_speed(0.1)                    # what sounds keeps sounding while the test looks
    c = d.connect()
    long_p = {"min_new_tokens": 100, "max_new_tokens": 100}
    c.send({"type": "speak", "text": "Alarm one.", "seed": 1, "id": "a0", "priority": "alert", "params": long_p})
    c.send({"type": "speak", "text": "Alarm two.", "seed": 2, "id": "a1", "priority": "alert", "params": long_p})
    c.send({"type": "speak", "text": "An answer.", "seed": 3, "id": "n2", "params": long_p})
    wait_for(lambda: heard(alsa_file) > 0, 60, "a0 sounding")
    evs = d.request({"type": "cancel", "channel": "main", "scope": "current"}, until=("cancel_done",))
    assert evs[-1]["type"] == "cancel_done" and evs[-1]["ids"] == ["a0"] and evs[-1]["scope"] == "current", evs
    evs = d.request({"type": "cancel", "channel": "main", "scope": "all"}, until=("cancel_done",))
    assert evs[-1]["type"] == "cancel_done" and sorted(evs[-1]["ids"]) == ["a1", "n2"], evs
    _, ends = c.events_until_ids({"a0", "a1", "n2"})
    c.close()
    assert {e["code"] for e in ends.values()} == {"cancelled"}
    alsa_file.set_speed(1.0)
    bad = d.request({"type": "cancel", "channel": "main", "scope": "everything"})
    assert bad[-1]["type"] == "error" and "'scope' must be one of current, queue, all" in bad[-1]["message"], bad


def _req(rid: str, priority: str, channel: str) -> Request:
    return Request(speak=Speak(text="x", id=rid, priority=priority), job=None, channel=channel, sink=lambda e: None)


def test_cancel_scopes_in_the_scheduler():
    s = Scheduler({"main": 8, "other": 8}, slots=2)
    # "p" plays (started first), "r" synthesizes behind it, an alert, a normal and a background
    # request are queued; "o" is another channel's
    reqs = {rid: _req(rid, pr, ch) for rid, pr, ch in (("p", "normal", "main"), ("r", "normal", "main"),
            ("aq", "alert", "main"), ("nq", "normal", "main"), ("bq", "background", "main"), ("o", "normal", "other"))}
    for it in reqs.values():
        s.check(it)
        s.enqueue(it)
    for rid, state, begun in (("p", State.PLAYING, 1), ("r", State.RUNNING, 2), ("o", State.RUNNING, 3)):
        s.queue.remove(reqs[rid])
        reqs[rid].state, reqs[rid].begun = state, begun
    ids = lambda scope: sorted(it.id for it in s.targets(None, "main", scope=scope))     # noqa: E731
    assert ids("current") == ["p"]                                  # what sounds; the rest goes on
    assert ids("queue") == ["bq", "nq", "p", "r"]                   # the pending alert still sounds
    assert ids("all") == ["aq", "bq", "nq", "p", "r"]
