"""Health's log says a condition once (when it starts, changes its severity, clears), not at
every moving reading; the throttle's reason inside its hysteresis band does not contradict its
threshold; repeated events are one summary line per key and interval."""

from __future__ import annotations

import logging

from appliance.config import ThrottleConfig
from appliance.core import UNHEALTHY, ConditionFlag
from appliance.ops.logsummary import Summary
from appliance.ops.readings import Reading
from appliance.ops.throttle import Throttle
from appliance.ops.verdict import Health, log_changes


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _lines(caplog, level=logging.INFO) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= level]


def test_a_moving_reading_is_logged_once_and_a_severity_change_again(caplog):
    caplog.set_level(logging.DEBUG, logger="appliance.ops.verdict")
    clock = Clock()
    flag = ConditionFlag("throttled", clock=clock)
    h = Health([flag], clock=clock)
    levels, last = {}, h.verdict().key()
    for temp in (83.1, 83.4, 83.9, 84.2, 83.0):                 # a reading that moves every second
        flag.set(f"reduced_channels by thermal: temperature {temp}C (>= 80.0C: reduced_channels)")
        v = h.verdict()
        levels, last = log_changes(levels, last, v.key(), v), v.key()
    warnings = [m for m in _lines(caplog, logging.WARNING)]
    assert len(warnings) == 1 and "83.1C" in warnings[0], warnings
    flag.severity = UNHEALTHY
    flag.set("alerts_only by thermal: temperature 88.0C")
    v = h.verdict()
    levels, last = log_changes(levels, last, v.key(), v), v.key()
    assert "throttled now unhealthy (was degraded)" in _lines(caplog, logging.WARNING)[-1]
    flag.clear()
    v = h.verdict()
    log_changes(levels, last, v.key(), v)
    assert any("throttled cleared" in m for m in _lines(caplog))
    assert sum("temperature" in m for m in _lines(caplog)) == 5    # 2 changes (+ summaries), 1 clear; was 2 per reading


def test_inside_the_hysteresis_band_the_reason_says_until_when():
    clock = Clock()
    th = Throttle(ThrottleConfig(min_dwell_s=0.0, trip_c=90.0, temp_hysteresis_c=5.0), channels=2, clock=clock)
    th.update(Reading(t=0.0, temps_c={"tj": 76.0}))                       # >= 75: reduced_channels
    assert th.level == "reduced_channels"
    th.update(Reading(t=1.0, temps_c={"tj": 73.0}))                       # below 75, above 70: stays
    (cond,) = th.conditions()
    assert "temperature 73.0C (reduced_channels until below 70.0C)" in cond.reason, cond.reason
    assert ">= 75.0C" not in cond.reason


def test_a_summary_is_one_line_per_key_and_interval(caplog):
    caplog.set_level(logging.INFO)
    clock = Clock()
    s = Summary(10.0, logging.getLogger("t"), clock)
    for i in range(1000):
        s.note("a", "client #1", "malformed lines", f"bad {i}")
        s.note("b", "client #2", "malformed lines")
    assert _lines(caplog) == []                                           # within the interval: nothing
    clock.t += 10
    s.note("a", "client #1", "malformed lines", "bad last")
    assert _lines(caplog) == ["client #1: 1001 malformed lines in 10 s (last: bad last)"]
    assert s.flush(due_only=True) == 1 and "client #2: 1000 malformed lines" in _lines(caplog)[-1]


def test_the_markdown_parsers_trace_stays_out_of_a_verbose_log(capfd):
    from appliance.ops import logsetup
    from appliance.ops.logsetup import setup_logging
    import appliance.text.markup  # noqa: F401 - imports markdown_it

    root = logging.getLogger()
    saved = list(root.handlers), root.level
    try:
        setup_logging(verbose=True, environ={})
        import markdown_it
        markdown_it.MarkdownIt("commonmark").render("# title\n\n* a **b** [c](http://x)\n" * 20)
        logging.getLogger("appliance.test").debug("ours")
        assert logsetup.flush()        # the records go through the writer thread to stderr's descriptor
        err = capfd.readouterr().err
        assert "ours" in err and "markdown_it" not in err, err[-2000:]
    finally:
        logsetup.stop()
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in saved[0]:
            root.addHandler(h)
        root.setLevel(saved[1])
