"""Three channels over MQTT: three ``say`` messages for three channels, each bound to its own ALSA
``file`` device (the three-PCM ``.asoundrc`` of tests/test_channels_service.py), synthesize
concurrently and each device receives exactly its own request's samples."""

from __future__ import annotations

from tests.fixtures_mqtt import Listener, mqtt_section
from tests.fixtures_service import service_config
from tests.test_channels_service import (
    CHANNELS,
    alsa_channels,
    assert_close,
    expected,
    speech,
    wait_len,
)


def test_three_channels_over_mqtt_each_device_gets_its_own_request(tiny_ckpt, tmp_path, start_daemon,
                                                                   mqtt_broker, service_pipeline):
    files = alsa_channels(tmp_path / "home", {n: tmp_path / f"{n}.raw" for n in CHANNELS})
    chans = [{"name": n, "device": f"tts_{n}", "queue_len": 2} for n in CHANNELS]
    mq = mqtt_section(mqtt_broker)
    cfg = service_config(tiny_ckpt, tmp_path, audio={"output": "device"}, service={"channels": chans},
                         synthesis={"max_new_tokens": 200, "voice": "seed:2"}, telemetry={"source": "none"},
                         health={"at_start": False}, mqtt=mq)
    lst = Listener(mqtt_broker, f"{mq['topic_prefix']}/{mq['device_id']}")
    try:
        d = start_daemon(cfg, alsa=next(iter(files.values())))
        lst.wait(lambda m: m.leaf == "availability" and m.payload == b"online", 30, "online")
        p = dict(min_new_tokens=80, max_new_tokens=90)
        reqs = {n: (f"MQTT channel {n}, message {i}.", 70 + i) for i, n in enumerate(CHANNELS)}
        for n, (text, seed) in reqs.items():
            lst.publish("say", {"text": text, "seed": seed, "id": f"m-{n}", "channel": n, "params": p})
        for n in CHANNELS:
            done = lst.wait_event(f"m-{n}")
            assert done["type"] == "done" and done["channel"] == n and done["output"] == f"device:tts_{n}", done
        for n, (text, seed) in reqs.items():
            want = speech(expected(service_pipeline, text, seed, **p))
            got = wait_len(files[n], len(want))
            assert_close(got[:len(want) + 1], want, f"channel {n}")     # its own samples, nothing else
        log = d.log()
        for n in CHANNELS:      # synthesized together: the decode batch reached 3 rows
            line = next(l for l in log.splitlines() if f"synthesized m-{n} on {n}:" in l)
            assert "decode batch up to 3 rows" in line, line
    finally:
        lst.close()
