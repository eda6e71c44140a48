"""Bounded throttling: a request held by the throttle ends ``throttled`` at ``service.max_hold_s``
naming the resource; memory pressure (a fixture /proc/meminfo, a real memory cgroup) refuses the
priorities it holds back with ``insufficient_memory`` and serves the rest; held requests start
once the cause has been clear for the hold-off. The scheduler's hold accounting on a scripted
clock; the daemon with its telemetry reading a fixture tree (``telemetry.root``) or the real one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from appliance.config import ThrottleConfig
from appliance.errors import InsufficientMemoryError
from appliance.messages.protocol import Speak
from appliance.ops.readings import Reading
from appliance.ops.throttle import Throttle
from appliance.service.request import Request
from appliance.service.scheduler import Scheduler
from tests.fixtures_service import launch_daemon, service_config
from tests.test_ops_verdict import board, set_board
from tests.waits import wait_for


class Clock:
    def __init__(self) -> None:
        self.t = 500.0

    def __call__(self) -> float:
        return self.t


def _req(rid: str, priority: str = "normal", channel: str = "main") -> Request:
    return Request(speak=Speak(text="hello", id=rid, priority=priority, channel=channel), job=None,
                   channel=channel, sink=lambda ev: None)


def _hot(c: float, **kw) -> Reading:
    return Reading(t=0.0, temps_c={"tj": c}, **kw)


def test_the_scheduler_counts_only_the_throttles_holds_and_ends_them_at_max_hold_s():
    clock = Clock()
    th = Throttle(ThrottleConfig(min_dwell_s=0.0, trip_c=90.0), channels=2, clock=clock)
    s = Scheduler({"main": 4}, slots=2, throttle=th, max_hold_s=10.0, clock=clock)
    first, a = _req("first"), _req("a", "background")
    for r in (first, a):
        s.check(r)
        s.enqueue(r)
    assert [r.id for r in s.admit()] == ["first"]              # a waits behind it: not a hold
    assert s.holds == {}
    th.update(_hot(86.0))                                      # queue_low_priority: background held
    s.admit()
    clock.t += 6
    s.admit()
    th.update(_hot(50.0))                                      # released: behind 'first' again, not counted
    s.admit()
    clock.t += 3
    s.admit()
    th.update(_hot(86.0))
    s.ended()                                                  # 'first' is over: a is the head, held
    s.admit()
    assert s.waiting["main"].startswith("throttle level queue_low_priority by thermal: temperature 86.0C")
    assert s.waiting["main"].endswith("background requests wait (at most service.max_hold_s = 10 s)")
    clock.t += 3.9
    assert s.expired() == []                                   # 6 + 3.9 s held < 10
    clock.t += 0.2
    ((it, err),) = s.expired()
    assert it is a and a not in s.queue and a not in s.holds and err.code == "throttled"
    assert "held 10 s by the throttle" in str(err) and "by thermal" in str(err) and "service.max_hold_s is 10 s" in str(err)


def test_memory_pressure_refuses_held_priorities_with_insufficient_memory():
    clock = Clock()
    th = Throttle(ThrottleConfig(min_dwell_s=0.0), channels=1, clock=clock)
    s = Scheduler({"main": 4}, slots=1, throttle=th, max_hold_s=10.0, clock=clock)
    th.update(_hot(40.0, mem_total_mib=7782.0, mem_available_mib=300.0))    # <= 389: alerts_only by memory
    with pytest.raises(InsufficientMemoryError, match=r"not enough memory for a normal request now: throttle "
                                                      r"alerts_only by memory: available memory 300.0MiB"):
        s.check(_req("n"))
    assert s.check(_req("alert", "alert")) == (0, None)       # alerts are still served
    th.update(_hot(40.0, mem_total_mib=7782.0, mem_available_mib=4000.0))
    assert s.check(_req("n2")) == (0, None)


# ------------------------------------------------------------------------------- the daemon


def _cfg(tiny_ckpt, tmp_path, root: Path, **service) -> dict:
    return service_config(tiny_ckpt, tmp_path, telemetry={"source": "sysfs", "interval_s": 0.2, "root": str(root)},
                          throttle={"min_dwell_s": 1.0}, service=service)


def test_a_held_request_ends_throttled_at_max_hold_s_naming_the_heat(tiny_ckpt, tmp_path):
    root = board(tmp_path / "board", temp_c=93.0)                # >= 87C: alerts_only
    d = launch_daemon(tmp_path / "d", _cfg(tiny_ckpt, tmp_path, root, max_hold_s=1.0))
    try:
        wait_for(lambda: d.request({"type": "status"})[0]["throttle"] == "alerts_only", 20, "alerts_only")
        c = d.connect()
        c.send({"type": "speak", "text": "Held until it gives up.", "id": "held"})
        evs = c.events(("done", "error"))
        c.close()
        accepted, end = evs[0], evs[-1]
        assert accepted["type"] == "accepted" and "by thermal: temperature 93.0C" in accepted["waiting"], accepted
        assert end["type"] == "error" and end["code"] == "throttled", end
        assert "held 1 s by the throttle" in end["message"] and "alerts_only by thermal" in end["message"], end
        set_board(root, 50.0)
        wait_for(lambda: d.request({"type": "status"})[0]["health"] == "healthy", 20, "healthy")
        done = d.request({"type": "speak", "text": "Cool again.", "id": "after"})[-1]
        assert done["type"] == "done", done
    finally:
        assert d.stop() == 0, d.log()[-3000:]


def test_low_free_memory_serves_by_priority_and_held_requests_start_once_it_clears(tiny_ckpt, tmp_path):
    """A fixture /proc/meminfo: 700 of 7782 MiB free (a Jetson at 6.9 of 7.6 GB) is memory
    pressure: background refused with insufficient_memory, normal served; then free memory drops
    to 300 MiB (alerts_only): normal refused, an alert spoken; memory comes back: healthy, and
    requests are accepted again."""
    root = board(tmp_path / "board", avail_kb=700 * 1024)
    (root / "proc/meminfo").write_text(f"MemTotal: {7782 * 1024} kB\nMemAvailable: {700 * 1024} kB\n")
    d = launch_daemon(tmp_path / "d", _cfg(tiny_ckpt, tmp_path, root))
    try:
        st = wait_for(lambda: (s := d.request({"type": "status"})[0])["throttle"] == "queue_low_priority" and s, 20,
                      "queue_low_priority by memory")
        assert st["health"] == "degraded" and "by memory: available memory 700.0MiB" in st["conditions"][0]["reason"]
        (err,) = d.request({"type": "speak", "text": "Background.", "id": "bg", "priority": "background"})
        assert err["type"] == "error" and err["code"] == "insufficient_memory", err
        assert "only alert, normal requests are served" in err["message"], err
        assert d.request({"type": "speak", "text": "Normal.", "id": "n1"})[-1]["type"] == "done"

        (root / "proc/meminfo").write_text(f"MemTotal: {7782 * 1024} kB\nMemAvailable: {300 * 1024} kB\n")
        wait_for(lambda: d.request({"type": "status"})[0]["throttle"] == "alerts_only", 20, "alerts_only")
        (err,) = d.request({"type": "speak", "text": "Normal.", "id": "n2"})
        assert err["code"] == "insufficient_memory" and "available memory 300.0MiB" in err["message"], err
        assert d.request({"type": "speak", "text": "Alert.", "id": "a1", "priority": "alert"})[-1]["type"] == "done"

        (root / "proc/meminfo").write_text(f"MemTotal: {7782 * 1024} kB\nMemAvailable: {6000 * 1024} kB\n")
        wait_for(lambda: d.request({"type": "status"})[0]["health"] == "healthy", 20, "healthy again")
        assert d.request({"type": "speak", "text": "Background.", "id": "bg2", "priority": "background"})[-1]["type"] == "done"
    finally:
        assert d.stop() == 0, d.log()[-3000:]


def test_a_deferred_request_plays_once_the_heat_has_cleared_for_the_hold_off(tiny_ckpt, tmp_path):
    root = board(tmp_path / "board", temp_c=86.0)                # queue_low_priority: background waits
    d = launch_daemon(tmp_path / "d", _cfg(tiny_ckpt, tmp_path, root, max_hold_s=600.0))
    try:
        wait_for(lambda: d.request({"type": "status"})[0]["throttle"] == "queue_low_priority", 20, "held level")
        c = d.connect()
        c.send({"type": "speak", "text": "Deferred.", "id": "later", "priority": "background"})
        (acc,) = c.events(("accepted",))
        assert "background requests wait" in acc["waiting"], acc
        set_board(root, 50.0)
        evs = c.events(("done", "error"))
        c.close()
        assert [e["type"] for e in evs][:1] == ["started"] and evs[-1]["type"] == "done", evs
        assert "throttle queue_low_priority -> normal: recovered: below queue_low_priority for" in d.log()
    finally:
        assert d.stop() == 0, d.log()[-3000:]


def _memory_cgroup() -> Path | None:
    """A fresh memory cgroup (v2 or v1) under this process's own, or None when none can be made."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hid, ctrls, path = line.split(":", 2)
        if hid == "0" and ctrls == "" and (Path("/sys/fs/cgroup") / path.lstrip("/") / "memory.max").exists():
            base = Path("/sys/fs/cgroup") / path.lstrip("/")
        elif "memory" in ctrls.split(","):
            base = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
        else:
            continue
        child = base / f"chattts-test-{os.getpid()}"
        try:
            child.mkdir()
            return child
        except OSError:
            return None
    return None


def _set_limit(cg: Path, mib: int) -> None:
    name = "memory.max" if (cg / "memory.max").exists() else "memory.limit_in_bytes"
    (cg / name).write_text(str(mib * 2**20))


def _usage_mib(cg: Path) -> float:
    name = "memory.current" if (cg / "memory.current").exists() else "memory.usage_in_bytes"
    return int((cg / name).read_text()) / 2**20


def _meminfo_available_mib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no MemAvailable")


def test_a_memory_cgroup_limit_is_memory_pressure_and_clears_when_raised(tiny_ckpt, tmp_path):
    cg = _memory_cgroup()
    if cg is None:
        pytest.skip("no memory cgroup can be made here")
    try:
        cfg = service_config(tiny_ckpt, tmp_path, telemetry={"source": "sysfs", "interval_s": 0.2},
                             throttle={"min_dwell_s": 1.0})
        enter = ["sh", "-c", f'echo $$ > {cg}/cgroup.procs && exec "$@"', "sh"]
        d = launch_daemon(tmp_path / "d", cfg, argv_prefix=enter)
        try:
            _set_limit(cg, int(_usage_mib(cg)) + 200)           # ~200 MiB left: <= 256, queue_low_priority
            st = wait_for(lambda: (s := d.request({"type": "status"})[0])["health"] == "degraded" and s, 20,
                          "memory pressure from the cgroup")
            reason = st["conditions"][0]["reason"]
            assert "by memory: available memory" in reason, st
            free = float(reason.split("available memory ")[1].split("MiB")[0])
            assert free <= 256 < _meminfo_available_mib(), reason          # the cgroup's headroom, not the box's
            (err,) = d.request({"type": "speak", "text": "Background.", "id": "bg", "priority": "background"})
            assert err["code"] == "insufficient_memory", err
            _set_limit(cg, 8192)
            wait_for(lambda: d.request({"type": "status"})[0]["health"] == "healthy", 20, "healthy")
            done = d.request({"type": "speak", "text": "Background.", "id": "bg2", "priority": "background"})[-1]
            assert done["type"] == "done", done
        finally:
            assert d.stop() == 0, d.log()[-3000:]
    finally:
        cg.rmdir()


def test_tegrastats_ram_on_a_jetson_is_the_free_memory_that_counts(tmp_path):
    """A tegrastats subprocess (a real executable printing an Orin Nano 8GB line, its RAM field
    rewritten between readings) over a sysfs base whose MemAvailable is large: 6900 of 7620 MiB
    used is memory pressure (720 MiB free < 762, 10 % of the total), named; 3452 used clears it."""
    from appliance.config import config_from_dict
    from appliance.ops.monitor import Monitor
    from appliance.ops.telemetry import open_telemetry
    from appliance.ops.verdict import Health

    orin = ("11-15-2024 08:38:09 RAM {used}/7620MB (lfb 8x2MB) SWAP 851/3810MB (cached 1MB) CPU [15%@729,11%@729,"
            "14%@729,13%@729,11%@729,8%@729] EMC_FREQ 43%@2133 GR3D_FREQ 63%@[621] cpu@53.968C soc2@52.437C "
            "soc0@50.75C gpu@53.343C tj@53.968C soc1@51.656C VDD_IN 12479mW/12479mW VDD_CPU_GPU_CV 4667mW/4667mW")
    root = board(tmp_path / "board", temp_c=50.0, avail_kb=16_000_000)
    line = tmp_path / "line.txt"
    line.write_text(orin.format(used=6900) + "\n")
    binary = tmp_path / "tegrastats"
    binary.write_text(f"#!/bin/sh\n# fake tegrastats: --interval MS\nwhile true; do cat {line}; sleep 0.05; done\n")
    binary.chmod(0o755)
    cfg = config_from_dict({"throttle": {"min_dwell_s": 0}})
    mon = Monitor(cfg, telemetry=open_telemetry("tegrastats", 0.1, root=str(root), tegrastats=str(binary)))
    try:
        h = Health([mon.conditions])
        wait_for(lambda: (mon._on_reading(mon.telemetry.read()), mon.level)[1] == "queue_low_priority", 10,
                 "memory pressure from tegrastats' RAM")
        (c,) = h.verdict().conditions
        assert c.reason.startswith("queue_low_priority by memory: available memory 720.0MiB (<= 762.0MiB"), c.reason
        line.write_text(orin.format(used=3452) + "\n")
        wait_for(lambda: (mon._on_reading(mon.telemetry.read()), mon.level)[1] == "normal", 10, "normal again")
        assert h.verdict().healthy
    finally:
        mon.close()


def test_a_journaled_request_is_never_refused_for_memory_it_waits_bounded():
    """A replay after a restart (already in the journal) under memory pressure is queued and held,
    not refused: it was accepted once; it ends ``throttled`` at max_hold_s if memory stays short."""
    clock = Clock()
    th = Throttle(ThrottleConfig(min_dwell_s=0.0), channels=1, clock=clock)
    s = Scheduler({"main": 4}, slots=1, throttle=th, max_hold_s=5.0, clock=clock)
    th.update(_hot(40.0, mem_total_mib=7782.0, mem_available_mib=700.0))      # queue_low_priority by memory
    replay = _req("replayed", "background")
    replay.journal = 7
    s.check(replay)
    s.enqueue(replay)
    assert s.admit() == [] and "by memory" in s.waiting["main"]
    clock.t += 5.0
    ((it, err),) = s.expired()
    assert it is replay and err.code == "throttled" and "by memory: available memory 700.0MiB" in str(err)
