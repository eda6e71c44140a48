"""A sentence's step cap in the real daemon (tiny checkpoint, real UNIX socket): each sentence gets
a cap proportional to its length (the ``normalized`` reply shows it: the 4 s floor for a short one,
the configured ceiling for a long one), decoding stops there, and a sentence that reaches it is
named in ``done.truncated`` and logged."""

from __future__ import annotations

import pytest

from appliance.text import budget
from tests.fixtures_service import launch_daemon, service_config

SHORT = "Hi there."
LONG = "This sentence is long enough that its expected speech passes the ceiling of the test daemon"


@pytest.fixture(scope="module")
def daemon(tiny_ckpt, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("svc_cap")
    d = launch_daemon(tmp / "d", service_config(tiny_ckpt, tmp, synthesis={"max_new_tokens": 300}))
    yield d
    assert d.stop() == 0, d.log()[-4000:]


def test_normalize_shows_a_cap_proportional_to_each_sentence(daemon):
    (ev,) = daemon.request({"type": "normalize", "text": f"{SHORT} {LONG}.", "id": "caps-1"},
                           until=("normalized", "error"))
    assert ev["type"] == "normalized", ev
    assert ev["spoken"] == [SHORT, LONG + "."]
    floor = budget.step_cap(SHORT, 300)
    assert floor == round(budget.MIN_CAP_S * budget.STEPS_PER_S) < 300    # 188: the floor
    assert ev["steps"] == [floor, 300]                                      # the long one: the ceiling


def test_a_sentence_that_reaches_its_cap_is_named_in_done_truncated(daemon):
    evs = daemon.request({"type": "speak", "text": f"{SHORT} {LONG}.", "id": "cut-1", "seed": 5,
                          "params": {"max_new_tokens": 6}})
    done = evs[-1]
    assert done["type"] == "done", evs
    assert done["spoken"] == [SHORT, LONG + "."]
    cut = {t["sentence"]: t for t in done["truncated"]}
    assert cut, done                                      # random weights draw no end in 6 steps
    for k, t in cut.items():
        assert t == {"sentence": k, "text": done["spoken"][k], "steps": 6}
    assert done["steps"] <= 12
    log = daemon.log()
    assert f"request cut-1: sentence {min(cut)} reached its cap of 6 decode steps" in log


def test_the_proportional_cap_bounds_decoding(daemon):
    evs = daemon.request({"type": "speak", "text": SHORT, "id": "cut-2", "seed": 7})
    done = evs[-1]
    assert done["type"] == "done", evs
    cap = budget.step_cap(SHORT, 300)
    assert done["steps"] <= cap                           # 188, not the configured 300
    assert all(t["steps"] == cap for t in done["truncated"]), done
