"""The one thread budget (appliance.engines.threads): the count comes from the CPU set the process
may use (a cgroup CPU quota, the affinity mask) unless model.threads says it; a real cgroup with a
1-CPU quota makes the real daemon pick 1 thread by itself and say so in ``status``."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from appliance.engines.threads import StepThreads, cpu_quota, thread_budget
from tests.fixtures_model import ONNX_LIMITS
from tests.fixtures_service import service_config

ROOT = Path(__file__).resolve().parents[1]


def _fake_proc(tmp: Path, cgroup_lines: str, mounts: list[tuple[str, str, str, str]]) -> Path:
    """A ``/proc`` with ``self/cgroup`` and ``self/mountinfo`` lines (fstype, root, point, options)."""
    d = tmp / "proc" / "self"
    d.mkdir(parents=True)
    (d / "cgroup").write_text(cgroup_lines)
    (d / "mountinfo").write_text("".join(
        f"{30 + i} 25 0:{40 + i} {root} {point} rw,nosuid - {fs} {fs} rw,{opts}\n"
        for i, (fs, root, point, opts) in enumerate(mounts)))
    return tmp / "proc"


def test_cgroup_v2_the_tightest_quota_on_the_path_wins(tmp_path):
    mnt = tmp_path / "cg2"
    leaf = mnt / "system.slice" / "chattts.service"
    leaf.mkdir(parents=True)
    (mnt / "system.slice" / "cpu.max").write_text("150000 100000\n")   # 1.5 CPUs on the parent
    (leaf / "cpu.max").write_text("max 100000\n")                       # none on the service itself
    proc = _fake_proc(tmp_path, "0::/system.slice/chattts.service\n", [("cgroup2", "/", str(mnt), "nsdelegate")])
    q = cpu_quota(proc)
    assert q is not None and q.cpus == 1.5 and "system.slice/cpu.max" in q.where
    b = thread_budget(0, proc)
    assert b.threads == 1     # 1.5 CPUs: rounded down
    if len(os.sched_getaffinity(0)) > 1:
        assert "cgroup CPU quota of 1.5 CPUs" in b.source and b.cpus == 1.5
    (leaf / "cpu.max").write_text("50000 100000\n")
    assert cpu_quota(proc).cpus == 0.5
    assert thread_budget(0, proc).threads == 1    # never 0


def test_cgroup_v1_cfs_quota_and_a_container_mount_root(tmp_path):
    mnt = tmp_path / "cpu"
    mnt.mkdir()
    (mnt / "cpu.cfs_quota_us").write_text("200000\n")
    (mnt / "cpu.cfs_period_us").write_text("100000\n")
    # inside a container the hierarchy's root is the container's cgroup, mounted as the mount's root
    proc = _fake_proc(tmp_path, "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n",
                      [("cgroup", "/docker/abc", str(mnt), "cpu,cpuacct")])
    q = cpu_quota(proc)
    assert q is not None and q.cpus == 2.0 and "cpu.cfs_quota_us" in q.where
    (mnt / "cpu.cfs_quota_us").write_text("-1\n")
    assert cpu_quota(proc) is None


def test_explicit_setting_wins_and_no_quota_means_the_affinity_mask(tmp_path):
    mnt = tmp_path / "cg2"
    mnt.mkdir()
    (mnt / "cpu.max").write_text("100000 100000\n")
    proc = _fake_proc(tmp_path, "0::/\n", [("cgroup2", "/", str(mnt), "")])
    b = thread_budget(3, proc)
    assert (b.threads, b.source) == (3, "model.threads")
    (mnt / "cpu.max").write_text("max 100000\n")
    n = len(os.sched_getaffinity(0))
    b = thread_budget(0, proc)
    assert b.threads == n and b.source == f"CPU affinity of {n} CPU{'' if n == 1 else 's'}"
    assert thread_budget(0, tmp_path / "no-proc").threads == n     # nothing readable: the mask


def _budget_in(argv_prefix: list[str]) -> str:
    code = "from appliance.engines.threads import thread_budget; print(thread_budget(0).describe())"
    return subprocess.run(argv_prefix + [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_affinity_mask_of_a_real_process():
    out = _budget_in(["taskset", "-c", str(min(os.sched_getaffinity(0)))])
    assert out == "1 thread (CPU affinity of 1 CPU)"


def _cpu_cgroup_dir() -> tuple[Path, str] | None:
    """Where a child cgroup with a CPU quota can be made here: (parent dir, ``v2`` or ``v1``)."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fs, opts, point = right.split()[0], right.split()[-1], left.split()[4]
        if fs == "cgroup2" and "cpu" in (Path(point) / "cgroup.subtree_control").read_text().split():
            return Path(point), "v2"
        if fs == "cgroup" and "cpu" in opts.split(","):
            return Path(point), "v1"
    return None


@pytest.fixture
def one_cpu_cgroup():
    """A real child cgroup with a quota of 1 CPU; yields the argv prefix that starts a command in it."""
    found = _cpu_cgroup_dir()
    if found is None or not os.access(found[0], os.W_OK):
        pytest.skip("no writable cgroup hierarchy with the cpu controller here")
    parent, version = found
    d = parent / f"chattts-test-{uuid.uuid4().hex[:8]}"
    try:
        d.mkdir()
        if version == "v2":
            (d / "cpu.max").write_text("100000 100000")
        else:
            (d / "cpu.cfs_period_us").write_text("100000")
            (d / "cpu.cfs_quota_us").write_text("100000")
    except OSError as e:
        pytest.skip(f"cannot make a cgroup with a CPU quota under {parent}: {e}")
    yield ["sh", "-c", f'echo $$ > {d}/cgroup.procs && exec "$@"', "sh"]
    for pid in (d / "cgroup.procs").read_text().split():     # one still running (a failed test's daemon)
        (parent / "cgroup.procs").write_text(pid)
    d.rmdir()


def test_a_real_one_cpu_quota_gives_one_thread(one_cpu_cgroup):
    out = _budget_in(one_cpu_cgroup)
    if len(os.sched_getaffinity(0)) == 1:
        assert out.startswith("1 thread")
    else:
        assert out.startswith("1 thread (cgroup CPU quota of 1 CPU (") and "cpu" in out


def test_the_daemon_under_a_one_cpu_quota_picks_one_thread_and_says_why(tiny_ckpt, onnx_dir, tmp_path, start_daemon,
                                                                        one_cpu_cgroup):
    cfg = service_config(tiny_ckpt, tmp_path, model={"backend": "onnxruntime", "engine_dir": str(onnx_dir),
                                                     "threads": 0, **ONNX_LIMITS})
    d = start_daemon(cfg, argv_prefix=one_cpu_cgroup)
    st = d.request({"type": "status"})[-1]
    want = 1 if len(os.sched_getaffinity(0)) > 1 else None
    assert st["threads"] == 1, st
    if want:
        assert st["threads_source"].startswith("cgroup CPU quota of 1 CPU"), st
        assert "1 thread (cgroup CPU quota of 1 CPU" in d.log()
    cfg["model"]["threads"] = 2        # an explicit setting wins over the quota
    d.stop()
    d2 = start_daemon(cfg, argv_prefix=one_cpu_cgroup, name="d2")
    st = d2.request({"type": "status"})[-1]
    assert (st["threads"], st["threads_source"]) == (2, "model.threads")
    assert d2.stop() == 0


def test_session_options_spin_only_inside_a_run_or_never():
    ort = pytest.importorskip("onnxruntime")
    from appliance.engines.onnx.vocoder import session_options

    so = session_options(ort, 2, spin_wait=True)
    assert so.intra_op_num_threads == 2 and so.inter_op_num_threads == 1
    assert so.get_session_config_entry("session.force_spinning_stop") == "1"
    so = session_options(ort, 2, spin_wait=False)
    assert so.get_session_config_entry("session.intra_op.allow_spinning") == "0"


def _run(st: StepThreads, cost: dict, steps: int, rows: int = 1) -> list[int]:
    """``steps`` decode steps whose time depends only on the thread count (``cost``: threads -> s)."""
    used = []
    for _ in range(steps):
        k = st.next(rows)
        used.append(k)
        st.observe(rows, k, cost[k])
    return used


def test_the_step_moves_to_one_thread_when_two_are_slower_and_back_when_the_cores_are_free():
    st = StepThreads(2, probe_every=20, probe_steps=2, first_probe=4)
    assert st.candidates == [2, 1] and st.current == 2
    contended = {2: 0.059, 1: 0.0099}            # a spinning barrier with a descheduled thread
    used = _run(st, contended, 8)
    assert used[:4] == [2, 2, 2, 2] and used[4:6] == [1, 1] and st.current == 1 and st.switches == 1
    used = _run(st, contended, 60)
    assert used.count(2) == 2 * 2 and st.current == 1    # probed twice more in 60 steps, stayed
    quiet = {2: 0.0078, 1: 0.0094}
    _run(st, quiet, 30)
    assert st.current == 2                               # the next probe finds two threads faster again


def test_a_small_difference_does_not_move_it_and_rows_are_compared_alike():
    st = StepThreads(2, probe_every=10, probe_steps=2, first_probe=3)
    _run(st, {2: 0.010, 1: 0.0095}, 50)                  # 5 % faster: not worth a move (gain 0.85)
    assert st.current == 2 and st.switches == 0
    st = StepThreads(2, probe_every=10, probe_steps=2, first_probe=3)
    _run(st, {2: 0.010, 1: 0.005}, 3, rows=1)
    k = st.next(3)                                       # a probe asked at three rows: nothing to compare yet
    assert k == 2
    assert StepThreads(1).candidates == [1] and _run(StepThreads(1), {1: 0.01}, 5) == [1] * 5
    assert StepThreads(8).candidates == [8, 4, 1]


def test_each_row_count_keeps_its_own_thread_choice():
    """One row bandwidth-bound beside a busy neighbour (one thread faster), three rows
    compute-bound (two threads faster): the choice at one row does not move three rows' steps."""
    st = StepThreads(2, probe_every=10, probe_steps=2, first_probe=3)
    one = {2: 0.0087, 1: 0.0064}
    three = {2: 0.011, 1: 0.018}
    _run(st, one, 20, rows=1)
    assert st.at(1) == 1 and st.current == 1
    used = _run(st, three, 40, rows=3)
    assert st.at(3) == 2 and st.at(1) == 1
    assert used.count(1) <= 3 * 2                # only probes ran three rows on one thread
    _run(st, one, 5, rows=1)
    assert st.current == 1 and st.switches == 1


def test_a_collapse_at_two_threads_probes_one_at_the_next_step():
    """A busy neighbour arrives: the two-thread step jumps from 8 to 89 ms; after two such steps
    the next probes one thread (26 ms) and moves there, instead of waiting for the next turn;
    one slow step alone moves nothing."""
    st = StepThreads(2, probe_every=256, probe_steps=2, first_probe=16)
    _run(st, {2: 0.008, 1: 0.010}, 40)           # quiet: the first probe found one thread slower
    assert st.current == 2
    assert _run(st, {2: 0.089, 1: 0.026}, 1) == [2]
    assert _run(st, {2: 0.008, 1: 0.010}, 3) == [2, 2, 2]      # a one-off spike: no probe
    used = _run(st, {2: 0.089, 1: 0.026}, 5)
    assert used == [2, 2, 1, 1, 1] and st.current == 1 and st.switches == 1
