"""BatchEngine on the tiny checkpoint: several jobs in ONE decode loop give the same PCM as each
job alone (same seed), a job joining mid-way and one cancelled mid-way do not disturb the others,
multi-sentence jobs stay in order."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from appliance.config import config_from_dict
from appliance.core import SynthesisRequest, SynthParams
from appliance.errors import CancelledError
from appliance.synth.batch import TaskState
from appliance.synth.pipeline import Pipeline

# Batched vs alone: a batched matmul computes each row with other kernels/blocking than a single
# row, and attention spans the longest row's positions (masked), so the PCM differs by float32
# rounding: measured max |diff| 1.0e-8 .. 1.2e-8 (torch CPU, tiny model, PCM peak ~1e-2).
# A differently sampled code would show as a gross difference instead.
PCM_ATOL = 1e-6


@pytest.fixture(scope="module")
def pipe(tiny_ckpt):
    cfg = config_from_dict({
        "model": {"path": str(tiny_ckpt), "backend": "torch", "device": "cpu", "threads": 1,
                  "max_batch": 3, "max_seq_len": 512, "max_prompt_tokens": 128},
        "synthesis": {"max_new_tokens": 60},
        "stream": {"chunk_tokens": 8, "first_chunk_tokens": 4},
    })
    p = Pipeline.from_config(cfg)
    yield p
    p.close()


REQS = [("你好。", 11), ("今天天气很好。", 12), ("我们去公园散步吧。", 13)]


def _alone(pipe, text, seed, **params):
    job = pipe.prepare(SynthesisRequest(text=text, id=f"alone-{seed}", seed=seed, params=SynthParams(**params)))
    return np.concatenate([c.samples for c in pipe.run(job)])


def _run_batched(pipe, jobs, start_at=None, cancel_at=None):
    """Drive the engine; ``start_at[i]``: engine step at which job i is added (default 0);
    ``cancel_at[i]``: step at which job i's cancel event is set."""
    eng = pipe.engine
    start_at = start_at or [0] * len(jobs)
    outs = [[] for _ in jobs]
    cancels = [threading.Event() for _ in jobs]
    tasks = [None] * len(jobs)
    step = 0
    while True:
        for i, j in enumerate(jobs):
            if tasks[i] is None and start_at[i] <= step:
                tasks[i] = eng.add(j, lambda c, o=outs[i]: o.append(c.samples), cancels[i])
            if cancel_at and cancel_at.get(i) == step:
                cancels[i].set()
        if all(t is not None and t.finished for t in tasks):
            break
        eng.step()
        step += 1
    assert not eng.tasks and eng.free == eng.capacity and pipe.loop.free_slots == pipe.loop.max_batch
    return tasks, [np.concatenate(o) if o else np.zeros(0, np.float32) for o in outs]


def _close(a, b):
    assert a.shape == b.shape, (a.shape, b.shape)
    assert np.abs(a - b).max() <= PCM_ATOL, np.abs(a - b).max()


def test_three_jobs_batched_equal_each_alone(pipe):
    alone = [_alone(pipe, t, s) for t, s in REQS]
    jobs = [pipe.prepare(SynthesisRequest(text=t, id=f"b{s}", seed=s)) for t, s in REQS]
    tasks, outs = _run_batched(pipe, jobs)
    for task, a, o in zip(tasks, alone, outs):
        assert task.state is TaskState.DONE and task.report.max_rows == 3
        _close(o, a)
    assert pipe.engine.rows_hist[3] > 0


def test_join_mid_way_and_cancel_mid_way(pipe):
    alone = [_alone(pipe, t, s) for t, s in REQS]
    jobs = [pipe.prepare(SynthesisRequest(text=t, id=f"m{s}", seed=s)) for t, s in REQS]
    # job 1 joins at step 7 while job 0 decodes; job 2 starts with them and is cancelled at step 10
    tasks, outs = _run_batched(pipe, jobs, start_at=[0, 7, 0], cancel_at={2: 10})
    assert tasks[0].state is TaskState.DONE and tasks[1].state is TaskState.DONE
    assert tasks[1].joined_at_step >= 7 and tasks[1].report.max_rows >= 2
    assert tasks[2].state is TaskState.CANCELLED and isinstance(tasks[2].error, CancelledError)
    _close(outs[0], alone[0])
    _close(outs[1], alone[1])
    assert len(outs[2]) < len(alone[2])


def test_multi_sentence_job_batched_keeps_order(pipe):
    text = "今天天气很好。" * 12 + "我们去公园散步吧。" * 12
    job = pipe.prepare(SynthesisRequest(text=text, id="long", seed=3))
    assert len(job.prompts) >= 2
    want = np.concatenate([c.samples for c in pipe.run(job)])
    jobs = [pipe.prepare(SynthesisRequest(text=text, id="long2", seed=3)), pipe.prepare(SynthesisRequest(text="你好。", id="s", seed=4))]
    tasks, outs = _run_batched(pipe, jobs)
    assert tasks[0].state is TaskState.DONE and tasks[0].report.max_rows == 2
    _close(outs[0], want)


def test_an_open_job_waits_for_its_next_sentences_and_ends_when_closed(pipe):
    """A job whose text still arrives (an utterance streamed in pieces): after its last sentence
    it waits (no decode row, the engine has no work), takes the sentences added meanwhile in
    order, and ends once closed; its PCM equals the whole text synthesized as one job."""
    whole = pipe.prepare(SynthesisRequest(text="你好。今天天气很好。我们去公园散步吧。", id="whole", seed=21))
    want = np.concatenate([c.samples for c in pipe.run(whole)])
    job = pipe.prepare(SynthesisRequest(text="你好。", id="open", seed=21)).opened()
    out: list = []
    eng = pipe.engine
    task = eng.add(job, lambda c: out.append(c.samples))
    rest = ["今天天气很好。", "我们去公园散步吧。"]
    steps = 0
    while not task.finished:
        if task.state is TaskState.WAITING:
            assert not eng.runnable and not pipe.loop.active        # nothing to do until text comes
            if rest:
                job.feed.put(pipe.prepare(SynthesisRequest(text=rest.pop(0), id="open", seed=99)))
            else:
                job.feed.close()
            assert eng.runnable
        eng.step()
        steps += 1
        assert steps < 10_000
    assert task.state is TaskState.DONE and task.report.spoken == ["你好。", "今天天气很好。", "我们去公园散步吧。"]
    assert [s.text for s in task.sentences] == task.report.spoken and task.fed == 2
    _close(np.concatenate(out), want)
    assert not eng.tasks and eng.free == eng.capacity
