"""bench/ as one instrument: every record under bench/results/ has the shared schema, the results
page and the README's benchmark table are what the records give, and ``python -m bench list`` /
``latest`` run from a clean tree (no build, no model)."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import BENCHES, BY_NAME, README_TABLE, RETIRED, harness
from bench.__main__ import main as bench_main, newest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def test_every_record_has_the_shared_fields_and_sits_in_its_benchs_file():
    files = sorted(p for p in RESULTS.iterdir())
    assert files and all(p.suffix == ".jsonl" for p in files), [p.name for p in files if p.suffix != ".jsonl"]
    n = 0
    for p in files:
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
            rec = json.loads(line)
            assert harness.check(rec) == [], (p.name, i, harness.check(rec))
            assert rec["bench"] == p.stem, (p.name, i, rec["bench"])
            assert list(rec)[:len(harness.SHARED)] == list(harness.SHARED), (p.name, i, list(rec)[:7])
            n += 1
    assert n == len(harness.read()) and n > 500


def test_every_records_bench_is_listed_or_retired():
    names = {r["bench"] for r in harness.read()}
    assert names <= set(BY_NAME) | set(RETIRED), names - set(BY_NAME) - set(RETIRED)


def test_each_runnable_benchmark_is_a_module_with_main_and_its_file_is_small():
    for b in BENCHES:
        if b.module is None:
            continue
        spec = importlib.util.find_spec(f"bench.{b.module}")
        assert spec is not None and spec.origin, b.name
        tree = ast.parse(Path(spec.origin).read_text())
        mains = [f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "main"]
        assert mains and mains[0].args.args and mains[0].args.args[0].arg == "argv", b.name
    files = [p for p in (ROOT / "bench").iterdir() if p.is_file()]
    assert len(files) <= 19, sorted(p.name for p in files)
    for p in files:
        if p.suffix in (".py", ".sh"):
            assert len(p.read_text().splitlines()) <= 400, p.name


def test_the_results_page_and_the_readme_table_are_current():
    """``python -m bench results --check``: RESULTS.md and README's table equal what the records give."""
    assert bench_main(["results", "--check"]) == 0


def test_every_readme_figure_comes_from_a_record():
    groups: dict[str, list[dict]] = {}
    for r in harness.read():
        groups.setdefault(r["bench"], []).append(r)
    for label, *cells in README_TABLE[1:]:
        for pieces in cells:
            for p in pieces:
                if isinstance(p, str):
                    continue
                name, filters, form = p
                assert name in BY_NAME, (label, name)
                assert any(all(r.get(k) == v for k, v in filters.items()) for r in groups.get(name, [])), (label, p)
    page = (ROOT / "bench" / "RESULTS.md").read_text()
    assert "`shipped.jsonl:" in page and "`bench/gpu.sh shipped`" in page    # each figure names its record


def test_list_and_latest_run_in_a_fresh_interpreter(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("BENCH_OUT", "BENCH_MACHINE")}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-m", "bench", "list"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for b in BENCHES:
        assert b.name in out.stdout and b.question in out.stdout
    lat = subprocess.run([sys.executable, "-m", "bench", "latest", "--bench", "shipped", "--machine", "h200"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert lat.returncode == 0, lat.stderr
    rows = [line for line in lat.stdout.splitlines() if line.startswith("| h200 |")]
    assert len(rows) == 1 and "memory_mib_at_ready" in lat.stdout, lat.stdout


def test_a_record_written_through_the_harness_is_read_back_and_a_bad_one_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("BENCH_MACHINE", "test-box")
    rec = harness.record("step", checkpoint="tiny", backend="onnxruntime", notes="n", ms_per_step=1.5,
                         host_info=harness.host(1.0))
    assert list(rec)[:7] == list(harness.SHARED) and rec["machine"] == "test-box" and rec["host"]["read_gbps"] == 1.0
    harness.write([rec, {**rec, "ms_per_step": 1.0}], tmp_path)
    back = harness.read(tmp_path)
    assert [r["ms_per_step"] for r in back] == [1.5, 1.0] and back[1]["_line"] == 2
    assert newest(back, ("backend",))[0]["ms_per_step"] == 1.0      # the later line of one date
    with pytest.raises(ValueError, match="missing commit"):
        harness.write([{k: v for k, v in rec.items() if k != "commit"}], tmp_path)
    with pytest.raises(ValueError, match="shared fields"):
        harness.record("step", checkpoint=None, backend=None, machine="x", date="2026")


def test_candidates_run_in_turns_with_a_rotating_first():
    order: list[str] = []
    res = harness.in_turns({n: (lambda n=n: order.append(n) or len(order)) for n in ("a", "b", "c")}, rounds=3)
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert {k: len(v) for k, v in res.items()} == {"a": 3, "b": 3, "c": 3}
