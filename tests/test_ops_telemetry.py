"""Telemetry: the tegrastats parser on every real sample line, sysfs/meminfo readers on a fixture
tree, a real tegrastats-like subprocess, and source selection on this machine."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from appliance.errors import ConfigError
from appliance.ops.readings import Reading, Trip, merge, parse_tegrastats
from appliance.ops.sources import SysfsSource
from appliance.ops.telemetry import (
    appliance_memory_mib,
    open_telemetry,
    process_memory_mib,
)

SAMPLES_FILE = Path("/work/shared/tegrastats-samples.txt")

# Every line of shared/tegrastats-samples.txt, verbatim, with what it must parse to:
# (line, mem_used, mem_total, tj, gpu (None = offline/absent), power_mw, gpu_load, cores, offline cores, offline sensors)
SAMPLES = [
    # AGX Orin 64GB, JP 5.1, root: two GR3D fields, uppercase sensors, no VDD_IN (sum of rails), NC rails
    ("04-24-2023 00:01:24 RAM 1282/62795MB (lfb 15152x4MB) SWAP 0/31398MB (cached 0MB) CPU [0%@729,0%@729,0%@729,0%@729,0%@729,0%@729,0%@729,0%@729,0%@729,0%@729,0%@729,0%@729] EMC_FREQ 0%@2133 GR3D_FREQ 0%@0 GR3D2_FREQ 0%@0 VIC_FREQ 729 APE 174 CV0@-256C CPU@42.593C Tboard@32C SOC2@39.343C Tdiode@33.25C SOC0@39.375C CV1@-256C GPU@-256C tj@42.593C SOC1@40.468C CV2@-256C VDD_GPU_SOC 2399mW/2399mW VDD_CPU_CV 400mW/400mW VIN_SYS_5V0 4032mW/4032mW NC 0mW/0mW VDDQ_VDD2_1V8AO 301mW/301mW NC 0mW/0mW",
     1282, 62795, 42.593, None, 2399 + 400 + 4032 + 301, 0.0, 12, 0, {"cv0", "cv1", "cv2", "gpu"}),
    # AGX Orin 64GB, JP 5.x, root, bracketed GR3D
    ("04-11-2025 10:36:27 RAM 4321/62801MB (lfb 1759x4MB) SWAP 19/31400MB (cached 0MB) CPU [0%@729,0%@729,0%@729,0%@729,0%@729,0%@729,0%@729,0%@729,0%@729,0%@729,0%@729,0%@729] EMC_FREQ 0%@2133 GR3D_FREQ 0%@[0,0] VIC_FREQ 729 APE 174 CV0@-256C CPU@44.562C Tboard@32C SOC2@40.093C Tdiode@33C SOC0@41.093C CV1@-256C GPU@-256C tj@44.343C SOC1@41.25C CV2@-256C VDD_GPU_SOC 2340mW/2340mW VDD_CPU_CV 390mW/390mW VIN_SYS_5V0 4025mW/4025mW NC 0mW/0mW VDDQ_VDD2_1V8AO 301mW/301mW NC 0mW/0mW",
     4321, 62801, 44.343, None, 2340 + 390 + 4025 + 301, 0.0, 12, 0, {"cv0", "cv1", "cv2", "gpu"}),
    # AGX Orin 32GB, JP 5.x, NON-root: no rails, no clocks
    ("03-08-2024 07:49:04 RAM 1438/30622MB (lfb 6704x4MB) SWAP 0/15311MB (cached 0MB) CPU [2%@729,0%@729,4%@729,0%@729,2%@729,0%@729,0%@729,2%@729] EMC_FREQ 0% GR3D_FREQ 0% CV0@-256C CPU@44.437C Tboard@36C SOC2@42.562C Tdiode@35.75C SOC0@42.062C CV1@-256C GPU@-256C tj@44.437C SOC1@43.031C CV2@-256C",
     1438, 30622, 44.437, None, None, 0.0, 8, 0, {"cv0", "cv1", "cv2", "gpu"}),
    # AGX Orin 64GB, JP 6.x, root: lowercase sensors, 4 cores off, engines 'off', 3 rails
    ("07-21-2025 16:33:42 RAM 17953/62841MB (lfb 9x4MB) SWAP 0/31420MB (cached 0MB) CPU [7%@1728,31%@1036,7%@1036,42%@1036,4%@1420,5%@729,6%@729,1%@729,off,off,off,off] EMC_FREQ 12%@204 GR3D_FREQ 39%@[305,0] NVENC off NVDEC off NVJPG off NVJPG1 off VIC off OFA off NVDLA0 off NVDLA1 off PVA0_FREQ off APE 174 cpu@43.906C soc2@40.406C soc0@41.187C gpu@40.093C tj@43.906C soc1@40.437C VDD_GPU_SOC 2798mW/2798mW VDD_CPU_CV 799mW/799mW VIN_SYS_5V0 3315mW/3315mW",
     17953, 62841, 43.906, 40.093, 2798 + 799 + 3315, 39.0, 12, 4, set()),
    # Orin Nano 8GB, JP 6.x, root, under load: VDD_IN
    ("11-15-2024 08:38:09 RAM 6185/7620MB (lfb 8x2MB) SWAP 851/3810MB (cached 1MB) CPU [15%@729,11%@729,14%@729,13%@729,11%@729,8%@729] EMC_FREQ 43%@2133 GR3D_FREQ 63%@[621] NVDEC off NVJPG off NVJPG1 off VIC off OFA off APE 200 cpu@53.968C soc2@52.437C soc0@50.75C gpu@53.343C tj@53.968C soc1@51.656C VDD_IN 12479mW/12479mW VDD_CPU_GPU_CV 4667mW/4667mW VDD_SOC 2817mW/2817mW",
     6185, 7620, 53.968, 53.343, 12479, 63.0, 6, 0, set()),
    # Orin Nano 8GB, JP 6.x, NON-root: no EMC, GR3D without clock
    ("06-18-2025 11:25:24 RAM 3452/7620MB (lfb 25x4MB) SWAP 1518/16384MB (cached 174MB) CPU [1%@1420,2%@1420,0%@1420,2%@1420,2%@729,1%@729] GR3D_FREQ 0% cpu@50.031C soc2@49.031C soc0@50C gpu@49.031C tj@50.25C soc1@50.25C VDD_IN 4824mW/4824mW VDD_CPU_GPU_CV 518mW/518mW VDD_SOC 1475mW/1475mW",
     3452, 7620, 50.25, 49.031, 4824, 0.0, 6, 0, set()),
    # Orin Nano 8GB, JP 6.x, non-root, 2 cores off, a rail printed as '598mW/598'
    ("12-23-2024 22:54:11 RAM 3162/7620MB (lfb 4x2MB) SWAP 0/3810MB (cached 0MB) CPU [1%@729,0%@729,0%@729,0%@729,off,off] GR3D_FREQ 1% cpu@62.843C soc2@61.968C soc0@60.625C gpu@61.687C tj@62.843C soc1@61.687C VDD_IN 3913mW/3922mW VDD_CPU_GPU_CV 598mW/598 VDD_SOC 1238mW/1237mW",
     3162, 7620, 62.843, 61.687, 3913, 1.0, 6, 2, set()),
    # Orin Nano 8GB, JP 6.x, root, idle
    ("11-30-2025 13:26:01 RAM 2461/7620MB (lfb 3x2MB) SWAP 1243/3810MB (cached 5MB) CPU [19%@729,14%@729,22%@729,8%@729,15%@729,17%@729] EMC_FREQ 4%@2133 GR3D_FREQ 0%@[305] NVDEC off NVJPG off NVJPG1 off VIC off OFA off APE 200 cpu@46.531C soc2@47.312C soc0@46.593C gpu@48.218C tj@48.843C soc1@48.843C VDD_IN 5704mW/5704mW VDD_CPU_GPU_CV 831mW/831mW VDD_SOC 1624mW/1624mW",
     2461, 7620, 48.843, 48.218, 5704, 0.0, 6, 0, set()),
    # Xavier NX (contrast): no tj, PMIC constant; hottest die sensor is CPU 40C
    ("10-01-2025 20:05:55 RAM 2274/6834MB (lfb 27x4MB) SWAP 542/3417MB (cached 2MB) CPU [99%@1189,100%@1188,100%@1189,98%@1189,off,off] EMC_FREQ 0% GR3D_FREQ 22% AUX@36.5C CPU@40C thermal@37.85C AO@37.5C GPU@38C PMIC@50C VDD_IN 5542mW/5542mW VDD_CPU_GPU_CV 1594mW/1594mW VDD_SOC 1234mW/1234mW",
     2274, 6834, None, 38.0, 5542, 22.0, 6, 2, set()),
]

# JetPack 7 (not in the samples file; built from the format notes in reference/jetson-platform.md
# §1.2: two values per sensor, three per rail; AGX has no VDD_IN).
JP7_AGX = ("02-01-2026 09:00:00 RAM 5120/62841MB (lfb 12x4MB) SWAP 0/31420MB (cached 0MB) CPU [3%@1728,5%@1728,off,off] "
           "EMC_FREQ 2%@3199 GR3D_FREQ 12%@[1300,1300] cpu@52.968C/52.968C gpu@50.1C/50.1C tj@53.5C/53.5C cv0@-256C/-256C "
           "VDD_GPU_SOC 5139mW/5139mW/5139mW VDD_CPU_CV 1200mW/1100mW/1300mW VIN_SYS_5V0 3000mW/3000mW/3000mW")


@pytest.mark.parametrize("row", SAMPLES, ids=[f"sample{i}" for i in range(len(SAMPLES))])
def test_parse_every_sample_line(row):
    line, used, total, tj, gpu, power, load, cores, off_cores, offline = row
    r = parse_tegrastats(line + "\n", t=1.0)
    assert r.source == "tegrastats" and r.t == 1.0
    assert (r.mem_used_mib, r.mem_total_mib) == (used, total)
    assert r.mem_available_mib == total - used
    assert r.tj_c == tj
    assert r.gpu_c == gpu
    assert r.power_mw == power
    assert r.gpu_load_pct == load
    assert len(r.cpu_load_pct) == cores
    assert sum(1 for c in r.cpu_load_pct if c is None) == off_cores
    assert set(r.offline) == offline
    assert all(v > -200 for v in r.temps_c.values())      # -256C never leaks into temps
    assert "NC" not in r.rails_mw and "RAM" not in r.rails_mw and "SWAP" not in r.rails_mw
    assert r.hot_c == (tj if tj is not None else max(v for k, v in r.temps_c.items() if k != "pmic"))


def test_samples_table_covers_the_shared_file():
    if not SAMPLES_FILE.exists():
        pytest.skip(f"{SAMPLES_FILE} not on this machine")
    lines = [ln.rstrip("\n") for ln in SAMPLES_FILE.read_text(encoding="utf-8").splitlines()
             if ln.strip() and not ln.startswith("#")]
    assert lines == [row[0] for row in SAMPLES]


def test_uppercase_and_lowercase_sensor_names_share_keys():
    jp5, jp6 = parse_tegrastats(SAMPLES[2][0]), parse_tegrastats(SAMPLES[3][0])
    assert {"cpu", "tj", "soc0"} <= set(jp5.temps_c) and {"cpu", "tj", "soc0"} <= set(jp6.temps_c)
    assert parse_tegrastats(SAMPLES[0][0]).temps_c["tboard"] == 32.0


def test_rail_with_bare_second_value():
    r = parse_tegrastats(SAMPLES[6][0])
    assert r.rails_mw == {"VDD_IN": 3913.0, "VDD_CPU_GPU_CV": 598.0, "VDD_SOC": 1238.0}


def test_jetpack7_two_temps_three_rail_values():
    r = parse_tegrastats(JP7_AGX)
    assert r.temps_c == {"cpu": 52.968, "gpu": 50.1, "tj": 53.5}
    assert r.offline == ("cv0",)
    assert r.rails_mw == {"VDD_GPU_SOC": 5139.0, "VDD_CPU_CV": 1200.0, "VIN_SYS_5V0": 3000.0}
    assert r.power_mw == 5139 + 1200 + 3000
    assert r.gpu_load_pct == 12.0
    assert r.cpu_load_pct == (3.0, 5.0, None, None)


def test_missing_fields_stay_none():
    r = parse_tegrastats("RAM 100/7620MB (lfb 4x2MB) tj@40C")
    assert (r.mem_used_mib, r.tj_c) == (100, 40.0)
    assert r.power_mw is None and r.gpu_load_pct is None and r.cpu_load_pct == () and r.rails_mw == {}
    r = parse_tegrastats("cpu@-256C gpu@-256C")                 # all sensors off, nothing else
    assert r.temps_c == {} and set(r.offline) == {"cpu", "gpu"} and r.hot_c is None and r.mem_total_mib is None
    r = parse_tegrastats("RAM 512/1024kB")                       # other size unit
    assert r.mem_total_mib == 1.0
    with pytest.raises(ValueError, match="not a tegrastats line"):
        parse_tegrastats("tegrastats: command not found")


def test_merge_prefers_top_and_fills_from_base():
    base = Reading(t=1.0, source="sysfs", temps_c={"tj": 40.0, "board": 30.0}, nvmap_mib=512.0,
                   mem_total_mib=7620.0, mem_used_mib=1000.0, rails_mw={"VDD_IN": 4000.0}, power_mw=4000.0)
    top = parse_tegrastats(SAMPLES[5][0], t=2.0)
    m = merge(base, top)
    assert m.source == "tegrastats+sysfs" and m.t == 2.0
    assert m.tj_c == 50.25 and m.temps_c["board"] == 30.0
    assert m.nvmap_mib == 512.0                                   # only the base knows NvMapMemUsed
    assert m.mem_used_mib == 3452 and m.power_mw == 4824


def _write(p: Path, text: str) -> None:
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


@pytest.fixture
def orin_tree(tmp_path):
    """A fixture /sys + /proc laid out like an Orin Nano on JP6 (values from the samples)."""
    zones = [("cpu-thermal", 50031, [("passive", 99000), ("critical", 104500)]),
             ("gpu-thermal", 49031, [("active", 46000), ("passive", 99000), ("critical", 104500)]),
             ("cv0-thermal", -256000, []),
             ("soc0-thermal", 50000, []),
             ("tj-thermal", 50250, [("passive", 97000)])]
    for i, (kind, temp, trips) in enumerate(zones):
        z = tmp_path / f"sys/class/thermal/thermal_zone{i}"
        _write(z / "type", kind + "\n")
        _write(z / "temp", f"{temp}\n")
        for j, (tt, tv) in enumerate(trips):
            _write(z / f"trip_point_{j}_type", tt + "\n")
            _write(z / f"trip_point_{j}_temp", f"{tv}\n")
    _write(tmp_path / "sys/class/thermal/thermal_zone5/type", "gone-thermal\n")   # no temp file: offline
    hw = tmp_path / "sys/class/hwmon/hwmon1"
    _write(hw / "name", "ina3221\n")
    for i, (label, mv, ma) in enumerate([("VDD_IN", 5000, 965), ("VDD_CPU_GPU_CV", 5000, 104), ("NC", 0, 0)], 1):
        _write(hw / f"in{i}_label", label)
        _write(hw / f"in{i}_input", str(mv))
        _write(hw / f"curr{i}_input", str(ma))
    _write(tmp_path / "sys/class/hwmon/hwmon0/name", "acpitz\n")
    _write(tmp_path / "sys/class/devfreq/17000000.gpu/device/load", "634\n")
    _write(tmp_path / "proc/meminfo", "MemTotal:        7802880 kB\nMemFree:  1000 kB\nMemAvailable:    4268032 kB\n"
                                      "NvMapMemUsed:     524288 kB\n")
    _write(tmp_path / "proc/self/status", "Name: python\nVmRSS:\t  204800 kB\n")
    return tmp_path


def test_sysfs_reader(orin_tree):
    src = SysfsSource(str(orin_tree))
    r = src.read()
    assert r.temps_c == {"cpu": 50.031, "gpu": 49.031, "soc0": 50.0, "tj": 50.25}
    assert set(r.offline) == {"cv0", "gone"}
    assert r.mem_total_mib == 7620.0 and r.mem_available_mib == 4168.0 and r.mem_used_mib == 7620.0 - 4168.0
    assert r.nvmap_mib == 512.0
    assert r.rails_mw == {"VDD_IN": 4825.0, "VDD_CPU_GPU_CV": 520.0}
    assert r.power_mw == 4825.0
    assert r.gpu_load_pct == 63.4
    trips = src.trips()
    assert Trip("tj", "passive", 97.0) in trips and Trip("gpu", "active", 46.0) in trips
    assert Trip("cpu", "critical", 104.5) in trips and len(trips) == 6
    assert src.describe() == "6 thermal zones, 1 INA3221, GPU load, NvMapMemUsed, no cgroup memory limit"
    assert process_memory_mib(root=str(orin_tree)) == 200.0


def test_appliance_memory_counts_gpu_memory():
    assert appliance_memory_mib(Reading(t=0, nvmap_mib=600.0), rss_mib=300.0) == 900.0
    assert appliance_memory_mib(Reading(t=0, gpu_mem_used_mib=1000.0), rss_mib=300.0) == 1300.0
    assert appliance_memory_mib(None, rss_mib=300.0) == 300.0
    assert appliance_memory_mib(Reading(t=0)) == pytest.approx(process_memory_mib(), rel=0.2)


def test_process_memory_of_this_process():
    rss = process_memory_mib()
    assert rss is not None and 10 < rss < 100_000


def _fake_tegrastats(tmp_path: Path, line: str) -> str:
    """A real executable that behaves like tegrastats: a line per --interval ms, forever."""
    p = tmp_path / "tegrastats"
    p.write_text("#!/bin/sh\n# fake tegrastats: --interval MS\nms=${2:-1000}\n"
                 f"while true; do echo '{line}'; sleep $(awk \"BEGIN{{print $ms/1000}}\"); done\n")
    p.chmod(p.stat().st_mode | stat.S_IEXEC)
    return str(p)


def test_tegrastats_subprocess_over_sysfs_base(orin_tree):
    binary = _fake_tegrastats(orin_tree, SAMPLES[5][0])
    tel = open_telemetry("auto", interval_s=0.1, root=str(orin_tree), tegrastats=binary,
                         jtop_socket=str(orin_tree / "run/jtop.sock"))
    try:
        assert tel.source_name == "tegrastats"
        assert "jtop: " in tel.reason and "absent" in tel.reason and "NvMapMemUsed" in tel.reason
        r = tel.read()
        assert r.source == "tegrastats+sysfs"
        assert r.tj_c == 50.25 and r.mem_used_mib == 3452          # from the tegrastats line
        assert r.nvmap_mib == 512.0                                 # from the sysfs base
        assert Trip("tj", "passive", 97.0) in tel.trips()
        got, done = [], threading.Event()

        def listener(reading):
            got.append(reading)
            if len(got) >= 3:
                done.set()

        tel.start(listener)
        assert done.wait(5)
        assert all(x.power_mw == 4824 for x in got)
        proc = tel._source._proc
    finally:
        tel.close()
    assert proc.poll() is not None                                  # the subprocess is gone


def test_auto_on_this_machine_says_why():
    tel = open_telemetry("auto", jtop_socket="/nonexistent/jtop.sock")
    try:
        r = tel.read()
        assert tel.reason
        assert r.mem_total_mib and r.mem_total_mib > 100
        assert r.mem_available_mib is not None and 0 < r.mem_available_mib <= r.mem_total_mib
        if tel.source_name == "sysfs":
            assert "tegrastats: not found" in tel.reason
    finally:
        tel.close()


def test_explicit_source_missing_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="tegrastats"):
        open_telemetry("tegrastats", tegrastats=None, root=str(tmp_path)) if not os.path.exists("/usr/bin/tegrastats") \
            else pytest.skip("this machine has tegrastats")
    with pytest.raises(ConfigError, match="jtop"):
        open_telemetry("jtop", jtop_socket=str(tmp_path / "jtop.sock"))


def test_none_source():
    tel = open_telemetry("none")
    r = tel.read()
    assert tel.source_name == "none" and r.temps_c == {} and r.mem_total_mib is None


def _nvml_gpu() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        n = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
        return n > 0
    except Exception:  # noqa: BLE001 - no module, no driver, no GPU
        return False


@pytest.mark.cuda
@pytest.mark.skipif(not _nvml_gpu(), reason="needs nvidia-ml-py and an NVIDIA GPU")
def test_nvml_on_a_real_gpu():
    # Measured on an H200 (2026-11-30): gpu 41 C, 82.8 W, slowdown trip 89 C.
    tel = open_telemetry("auto", jtop_socket="/nonexistent/jtop.sock", tegrastats="")
    try:
        r = tel.read()
        assert tel.source_name == "nvml" and r.source.startswith("nvml")
        assert 5 < r.gpu_c < 120 and r.power_mw > 1000 and r.gpu_mem_total_mib > 1000
        assert any(t.kind == "passive" and 50 < t.temp_c < 120 for t in tel.trips())
    finally:
        tel.close()


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_cgroup_memory_the_tightest_limit_on_the_way_up(tmp_path, version):
    """A systemd unit's MemoryMax= under a slice with a larger one (v2 files), or the same as v1
    files: the unit's limit binds; reclaimable page cache (inactive_file) is not counted as used."""
    from appliance.ops.cgroup import cgroup_memory

    mib = 2**20
    if version == "v2":
        _write(tmp_path / "proc/self/cgroup", "0::/system.slice/chattts.service\n")
        top = tmp_path / "sys/fs/cgroup"
        files = ("memory.max", "memory.current", "inactive_file")
    else:
        _write(tmp_path / "proc/self/cgroup", "5:cpu,cpuacct:/\n4:memory:/system.slice/chattts.service\n")
        top = tmp_path / "sys/fs/cgroup/memory"
        files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    for d, limit, used, cache in ((top, None, 9000 * mib, 0), (top / "system.slice", 4096 * mib, 3000 * mib, 0),
                                  (top / "system.slice/chattts.service", 1500 * mib, 1300 * mib, 100 * mib)):
        none = "max" if version == "v2" else str(9223372036854771712)
        _write(d / files[0], f"{limit if limit is not None else none}\n")
        _write(d / files[1], f"{used}\n")
        _write(d / "memory.stat", f"anon 1\n{files[2]} {cache}\n")
    cg = cgroup_memory(str(tmp_path))
    assert cg is not None and cg.limit_mib == 1500 and cg.available_mib == 300          # 1500 - (1300 - 100)
    assert cg.path.endswith("system.slice/chattts.service")
    r = SysfsSource(str(tmp_path)).read()
    assert (r.cgroup_limit_mib, r.cgroup_available_mib) == (1500, 300) and r.free_mib == 300
    _write(top / "system.slice" / files[1], f"{3900 * mib}\n")                             # the slice is nearly full
    assert cgroup_memory(str(tmp_path)).available_mib == 196 and "cgroup memory limit 4096 MiB" in \
        SysfsSource(str(tmp_path)).describe()
    _write(tmp_path / "proc/self/cgroup", "0::/\n")
    assert cgroup_memory(str(tmp_path)) is None                                         # no limit anywhere
