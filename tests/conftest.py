"""Shared pytest set-up. Fixtures live in one plugin module per area (owned by that area):

* ``fixtures_model``   – random tiny checkpoint (session scope), goldens
* ``fixtures_service`` – ALSA ``file`` PCM, the real daemon on a real UNIX socket, NOTIFY_SOCKET
* ``fixtures_mqtt``    – a real mosquitto broker on a free port
* ``fixtures_ops``     – a real datagram socket collecting sd_notify messages (``notify_socket``)

Under ``pytest -n N --dist loadfile --no-loadscope-reorder`` (``scripts/test.sh``: N = 3) the
files listed in :data:`LONGEST_FIRST` are handed out first, longest first, so that no worker is
left alone with a long file at the end; the others follow in their usual order. One process (no
``-n``) keeps the usual order.
"""

import os

pytest_plugins = ["tests.fixtures_model", "tests.fixtures_service", "tests.fixtures_mqtt", "tests.fixtures_ops"]

LONGEST_FIRST = [
    # measured with --durations=0 (one process, 2026-12-02); only the order of the work changes
    "test_engines_aot.py",        # engines compile (AOTInductor C++), ~35-65 s before its first test
    "test_engines_onnx.py",       # makes the shared FP32 export, then an int8 one
    "test_faults_crash.py",
    "test_wyoming_daemon.py",
    "test_mqtt_daemon.py",
    "test_channels_service.py",
    "test_service_first_run.py",
    "test_wyoming_fuzz.py",
    "test_integrity_watch.py",
    "test_faults_mqtt.py",
    "test_gpu_loop.py",
    "test_service_cli.py",
    "test_integrity.py",
    "test_service_start.py",
    "test_engines_trt.py",
]


def pytest_collection_modifyitems(session, config, items):
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda it: rank.get(it.path.name, len(rank)))     # stable: the rest keep their order
