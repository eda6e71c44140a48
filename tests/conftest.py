"""Shared pytest set-up. Fixtures live in one plugin module per area (owned by that area):

* ``fixtures_model``   – random tiny checkpoint (session scope), goldens
* ``fixtures_service`` – ALSA ``file`` PCM, the real daemon on a real UNIX socket, NOTIFY_SOCKET
* ``fixtures_mqtt``    – a real mosquitto broker on a free port
* ``fixtures_ops``     – a real datagram socket collecting sd_notify messages (``notify_socket``)
"""

pytest_plugins = ["tests.fixtures_model", "tests.fixtures_service", "tests.fixtures_mqtt", "tests.fixtures_ops"]
