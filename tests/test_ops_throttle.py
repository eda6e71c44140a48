"""Throttle policy driven by scripted reading sequences: levels, hysteresis, dwell, reasons."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from appliance.config import ThrottleConfig, config_from_dict
from appliance.ops.readings import Reading, Trip, parse_tegrastats
from appliance.ops.throttle import Ladder, Level, Throttle, board_trip_c

ORIN_TRIPS = [Trip("cpu", "passive", 99.0), Trip("cpu", "critical", 104.5), Trip("gpu", "active", 46.0),
              Trip("gpu", "passive", 99.0), Trip("gpu", "critical", 104.5), Trip("tj", "passive", 97.0)]


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def temp(c: float, **kw) -> Reading:
    return Reading(t=0.0, temps_c={"tj": c, "gpu": c - 1}, **kw)


def make(cfg: ThrottleConfig | None = None, trips=ORIN_TRIPS, **kw):
    clock = Clock()
    changes = []
    th = Throttle(cfg or ThrottleConfig(), trips=trips, memory_budget_mb=1500, channels=3,
                  on_change=changes.append, clock=clock, **kw)
    return th, clock, changes


def run(th, clock, temps, step_s=10.0, **kw):
    out = []
    for c in temps:
        clock.t += step_s
        out.append(th.update(temp(c), **kw).value)
    return out


def test_thresholds_come_from_the_lowest_passive_trip():
    th, _, _ = make()
    assert th.trip_c == 97.0 and "tj passive trip 97.0C" in th.trip_source      # the 46C fan trip is ignored
    assert th.ladders["temperature"].thresholds == [82.0, 89.0, 94.0]
    assert board_trip_c([Trip("soc", "critical", 100.0)])[0] == 90.0
    assert board_trip_c([Trip("pmic", "passive", 40.0)]) is None
    th2, _, _ = make(trips=[])
    assert th2.trip_c == 95.0 and "fallback" in th2.trip_source
    th3, _, _ = make(ThrottleConfig(trip_c=80.0))
    assert th3.trip_c == 80.0 and "throttle.trip_c" in th3.trip_source


def test_heat_up_then_cool_down():
    th, clock, changes = make(ThrottleConfig(min_dwell_s=30.0))
    heat = run(th, clock, [50, 70, 81.9, 82.0, 85, 89.0, 93, 94.0, 96])
    assert heat == ["normal", "normal", "normal", "reduced_channels", "reduced_channels",
                    "queue_low_priority", "queue_low_priority", "alerts_only", "alerts_only"]
    # cooling: alerts_only is left below 94-5 = 89C, queue below 84C, reduced below 77C; the level
    # comes down once every signal has asked for less for 30 s, straight to what they ask for
    cool = run(th, clock, [92, 90, 88.9, 88, 86, 83.9, 80, 78, 76.9, 76, 60, 50], step_s=10.0)
    assert cool == ["alerts_only"] * 5 + ["reduced_channels"] * 6 + ["normal"]
    # a sudden cold board: normal 30 s after it cooled, not one level per dwell
    run(th, clock, [95])
    assert run(th, clock, [40] * 10) == ["alerts_only"] * 3 + ["normal"] * 7
    assert [(c.old.value, c.new.value) for c in changes] == [
        ("normal", "reduced_channels"), ("reduced_channels", "queue_low_priority"),
        ("queue_low_priority", "alerts_only"), ("alerts_only", "reduced_channels"),
        ("reduced_channels", "normal"), ("normal", "alerts_only"), ("alerts_only", "normal")]
    assert "temperature 82.0C (>= 82.0C: reduced_channels)" in changes[0].reason
    assert changes[4].reason.startswith("recovered: below reduced_channels for 30.0 s")


def test_recovery_waits_for_a_hold_off_that_restarts_when_the_cause_returns():
    th, clock, changes = make(ThrottleConfig(min_dwell_s=5.0))
    assert run(th, clock, [97]) == ["alerts_only"]
    assert run(th, clock, [40, 40, 40, 97, 40, 40, 40, 40, 40, 40], step_s=1.0) == \
        ["alerts_only"] * 9 + ["normal"]              # 3 s clear, hot again: 5 s counted from the next clear
    assert [c.new.value for c in changes] == ["alerts_only", "normal"]
    levels = run(th, clock, [97] + [40] * 20, step_s=10.0)    # a long dwell never keeps it longer
    assert levels[:2] == ["alerts_only"] * 2 and levels[2] == "normal"


def test_no_flapping_at_a_threshold():
    th, clock, changes = make(ThrottleConfig(min_dwell_s=0.0))
    wobble = [81.8, 82.1, 81.9, 82.3, 79.5, 82.0, 80.0, 81.99, 82.2, 77.5] * 10
    levels = run(th, clock, wobble, step_s=1.0)
    assert set(levels) == {"normal", "reduced_channels"}
    assert levels.index("reduced_channels") == 1
    assert all(lv == "reduced_channels" for lv in levels[1:])      # 77.5 > 82-5: never leaves
    assert len(changes) == 1
    assert run(th, clock, [76.9])[0] == "normal" and len(changes) == 2


def test_memory_pressure_against_budget():
    th, clock, changes = make(ThrottleConfig(min_dwell_s=0.0))
    seq = [(1000, "normal"), (1275, "reduced_channels"), (1430, "queue_low_priority"),
           (1580, "alerts_only"), (1500, "alerts_only"),                 # needs < 1575-75
           (1499, "queue_low_priority"), (1200, "reduced_channels"),     # 1200 is not < 1275-75
           (1199, "normal")]
    for mib, want in seq:
        clock.t += 1
        assert th.update(temp(40), app_mem_mib=mib).value == want, mib
    assert "memory 1275.0MiB (>= 1275.0MiB: reduced_channels)" in changes[0].reason


def test_low_system_memory_available():
    th, clock, _ = make(ThrottleConfig(min_dwell_s=0.0, min_available_mb=256))
    got = []
    for avail in [4000, 300, 250, 127, 180, 300, 330, 330]:   # hysteresis 64 MiB
        clock.t += 1
        got.append(th.update(temp(40, mem_available_mib=avail)).value)
    assert got == ["normal", "normal", "queue_low_priority", "alerts_only", "alerts_only",
                   "queue_low_priority", "normal", "normal"]      # down: straight to what the signals ask


def test_power_limit_with_hysteresis():
    th, clock, _ = make(ThrottleConfig(min_dwell_s=0.0, power_limit_mw=8000, power_hysteresis_mw=500))
    got = []
    for mw in [5000, 8000, 7600, 8800, 8500, 8200, 7400]:
        clock.t += 1
        got.append(th.update(temp(40, power_mw=mw)).value)
    assert got == ["normal", "reduced_channels", "reduced_channels", "queue_low_priority",
                   "queue_low_priority", "reduced_channels", "normal"]
    off, clock2, _ = make(ThrottleConfig(min_dwell_s=0.0))            # no limit: power ignored
    assert off.update(temp(40, power_mw=60000)) is Level.NORMAL


def test_rtf_measurements_and_their_expiry():
    th, clock, changes = make(ThrottleConfig(min_dwell_s=10.0, rtf_reduce=0.9, rtf_queue=1.2))
    clock.t += 1
    assert th.update(temp(40), rtf=0.5) is Level.NORMAL
    assert th.update(temp(40), rtf=0.95) is Level.REDUCED_CHANNELS
    th.observe_rtf(1.3)
    assert th.update(temp(40)) is Level.QUEUE_LOW_PRIORITY
    # no new requests: the last measurement is forgotten after max(60 s, 4 x dwell), then steps down
    levels = run(th, clock, [40] * 10, step_s=10.0)
    assert levels[0] == "queue_low_priority" and levels[-1] == "normal"
    assert "rtf 1.3" in changes[1].reason


def test_worst_signal_wins_and_logs_reason(caplog):
    th, clock, changes = make(ThrottleConfig(min_dwell_s=0.0))
    with caplog.at_level(logging.INFO, logger="appliance.ops.throttle"):
        clock.t += 1
        assert th.update(temp(85, mem_available_mib=100), app_mem_mib=100) is Level.ALERTS_ONLY
    assert "available memory 100.0MiB (<= 128.0MiB: alerts_only)" in changes[0].reason
    assert any("throttle normal -> alerts_only" in r.getMessage() and r.levelno == logging.WARNING
               for r in caplog.records)


def test_disabled_stays_normal():
    th, clock, changes = make(ThrottleConfig(enabled=False))
    assert run(th, clock, [100, 120]) == ["normal", "normal"] and changes == []


def test_limits_per_level():
    th, clock, _ = make(ThrottleConfig(min_dwell_s=0.0, reduced_channels=2, chunk_scale=3))
    lim = th.limits()
    assert (lim.max_channels, lim.chunk_scale, lim.run_priorities) == (3, 1, {"alert", "normal", "background"})
    run(th, clock, [83])
    assert (th.limits().max_channels, th.limits().chunk_scale) == (2, 1)
    run(th, clock, [90])
    lim = th.limits()
    assert (lim.max_channels, lim.chunk_scale, lim.run_priorities) == (2, 3, {"alert", "normal"})
    run(th, clock, [95])
    lim = th.limits()
    assert (lim.level, lim.max_channels, lim.run_priorities) == (Level.ALERTS_ONLY, 1, {"alert"})
    assert str(Level.ALERTS_ONLY) == "alerts_only" and Level.ALERTS_ONLY.rank == 3


def test_real_sample_readings_and_config_yaml_keys():
    cfg = config_from_dict({"throttle": {"power_limit_mw": 12000, "min_dwell_s": 0}})
    th, clock, _ = make(cfg.throttle)
    nano_loaded = parse_tegrastats("RAM 6185/7620MB CPU [15%@729] GR3D_FREQ 63%@[621] cpu@53.968C gpu@53.343C "
                                   "tj@53.968C VDD_IN 12479mW/12479mW VDD_CPU_GPU_CV 4667mW/4667mW")
    assert th.update(nano_loaded) is Level.REDUCED_CHANNELS          # 12.5 W >= 12 W limit, < 13.2 W
    assert "power 12479.0mW" in th.reason
    sensors_off = parse_tegrastats("RAM 1438/30622MB CV0@-256C GPU@-256C tj@-256C")
    clock.t += 1
    assert th.update(sensors_off) is Level.NORMAL                    # nothing known: released


def test_ladder_lower_is_worse_and_missing_thresholds():
    lad = Ladder("x", [None, 10.0, 5.0], 2.0, lower_is_worse=True)
    assert [lad.update(v) for v in (20, 10, 11, 12.1, 4, 6, 7.1, None)] == [0, 2, 2, 0, 3, 3, 2, 0]


def test_monitor_on_a_fake_hot_board(tmp_path):
    import threading

    from appliance.config import Config
    from appliance.ops.telemetry import open_telemetry
    from appliance.ops.monitor import Monitor

    z = tmp_path / "sys/class/thermal/thermal_zone0"
    z.mkdir(parents=True)
    (z / "type").write_text("tj-thermal\n")
    (z / "temp").write_text("50000\n")
    (z / "trip_point_0_type").write_text("passive\n")
    (z / "trip_point_0_temp").write_text("90000\n")
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/meminfo").write_text("MemTotal: 8000000 kB\nMemAvailable: 6000000 kB\n")
    changed = threading.Event()
    cfg = config_from_dict({"telemetry": {"interval_s": 0.1}, "throttle": {"min_dwell_s": 0}})
    mon = Monitor(cfg, on_change=lambda ch: changed.set(), telemetry=open_telemetry("sysfs", 0.1, root=str(tmp_path)))
    try:
        assert mon.throttle.trip_c == 90.0
        mon.start()
        assert mon.level == "normal"
        (z / "temp").write_text("86000\n")                    # 86C >= 90-8: queue_low_priority
        assert changed.wait(5)
        assert mon.level == "queue_low_priority" and mon.temperature_c == 86.0
        assert mon.limits().run_priorities == {"alert", "normal"}
        assert isinstance(Config().throttle, ThrottleConfig)
    finally:
        mon.close()


def test_monitor_counts_the_budget_figure_not_the_whole_gpu(tmp_path):
    """The throttle sees what the start-up fit checked (``budget_mib``: the figure counted against
    the budget by the box's kind), not NVML's whole-GPU figure; that figure (plus RSS) is used only
    when nothing set ``budget_mib``, and a budget figure that is not known now feeds no memory."""
    from appliance.ops.telemetry import Reading, open_telemetry, process_memory_mib
    from appliance.ops.monitor import Monitor

    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/meminfo").write_text("MemTotal: 8000000 kB\nMemAvailable: 6000000 kB\n")
    cfg = config_from_dict({"service": {"memory_budget_mb": 4096}, "throttle": {"min_dwell_s": 0}})
    mon = Monitor(cfg, telemetry=open_telemetry("sysfs", 60.0, root=str(tmp_path)))
    try:
        whole_gpu = Reading(t=0.0, gpu_mem_used_mib=8000.0)
        rss = process_memory_mib()
        mon.budget_mib = lambda: rss + 800.0
        mon._on_reading(whole_gpu)
        assert mon.memory_mib == pytest.approx(rss + 800.0)
        assert mon.level == "normal"                       # 8000 + RSS would be over 4096
        mon.budget_mib = lambda: None                      # not known now: no memory pressure
        mon._on_reading(whole_gpu)
        assert mon.memory_mib is None and mon.level == "normal"
        mon.budget_mib = None                              # nothing wired: the telemetry's figure
        mon._on_reading(whole_gpu)
        assert mon.memory_mib == pytest.approx(rss + 8000.0, abs=50.0)
        assert mon.level != "normal"
    finally:
        mon.close()


def test_free_memory_follows_the_box_total_and_a_cgroup():
    """6.9 of 7.6 GB used on a Jetson is pressure (0.1 of the total: 778 MiB); a cgroup's headroom
    counts when it is the least, and its limit bounds the total."""
    th, clock, changes = make(ThrottleConfig(min_dwell_s=0.0))
    jetson = Reading(t=0.0, temps_c={"tj": 40.0}, mem_total_mib=7782.0, mem_available_mib=700.0)
    clock.t += 1
    assert th.update(jetson) is Level.QUEUE_LOW_PRIORITY
    assert "available memory 700.0MiB (<= 778.2MiB: queue_low_priority)" in changes[0].reason
    lim = th.limits()
    assert lim.resources == {"memory"} and lim.cause.startswith("by memory: available memory 700.0MiB")
    boxed = Reading(t=0.0, temps_c={"tj": 40.0}, mem_total_mib=24000.0, mem_available_mib=16000.0,
                    cgroup_limit_mib=1024.0, cgroup_available_mib=100.0)
    assert (boxed.free_mib, boxed.total_mib) == (100.0, 1024.0)
    clock.t += 1
    assert th.update(boxed) is Level.ALERTS_ONLY                       # floor max(256, 102.4): 100 <= 128
    clock.t += 1
    assert th.update(dataclasses.replace(boxed, cgroup_available_mib=900.0)) is Level.NORMAL
    assert th.conditions() == ()
