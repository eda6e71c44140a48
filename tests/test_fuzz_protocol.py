"""Property-based fuzzing of the protocol (hypothesis), bounded in examples and time:

* the line parser and the MQTT payload parser turn *any* input into a request or an
  ``error`` (never another exception), and every error event serializes;
* the MQTT bridge's command handler never raises, and hands each payload to the daemon or
  answers it with exactly one ``error``;
* the real daemon on its real socket answers every fuzzed request line (JSON structure, types,
  sizes, UTF-8, nesting) with a terminal event, and is still serving afterwards with nothing
  raised past its edge (no traceback in its log).
"""

from __future__ import annotations

import json
import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from appliance.errors import ApplianceError
from appliance.messages.protocol import ErrorEvent, error_event, parse_line, to_json
from appliance.transports.mqtt_payload import parse_command
from tests.fixtures_service import launch_daemon, service_config

FIELDS = ["type", "text", "id", "channel", "priority", "voice", "seed", "params", "return_audio", "colour"]
PARAMS = ["temperature", "top_p", "top_k", "repetition_penalty", "min_new_tokens", "max_new_tokens", "prompt",
          "refine_text", "x"]
TYPES = ["speak", "cancel", "status", "health", "shout", ""]

scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
                    st.floats(allow_nan=False), st.text(max_size=40), st.sampled_from(TYPES),
                    st.sampled_from(["main", "alert", "normal", "seed:3", "你好"]))
json_values = st.recursive(scalars, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                            st.dictionaries(st.text(max_size=8), kids, max_size=4)),
                           max_leaves=12)
requests_ = st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=7) | st.fixed_dictionaries(
    {"type": st.sampled_from(TYPES)},
    optional={"text": st.text(max_size=60), "id": st.text(max_size=20), "seed": json_values,
              "channel": json_values, "priority": json_values,
              "params": st.dictionaries(st.sampled_from(PARAMS), json_values, max_size=4)})


def lines():
    """Request lines: JSON of fuzzed objects, raw bytes, deep nesting, lone surrogates, big ones."""
    as_json = requests_.map(lambda o: json.dumps(o, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    return st.one_of(
        as_json, as_json,
        json_values.map(lambda v: json.dumps(v).encode()),
        st.binary(max_size=200),
        st.integers(1, 3000).map(lambda n: b"[" * n + b"]" * n),
        st.integers(1, 3000).map(lambda n: b'{"a":' * n + b"1" + b"}" * n),
        st.text(alphabet=string.printable, max_size=80).map(lambda s: s.encode()),
        st.just(b'{"type":"speak","text":"\\ud800"}'),
        st.just(b'{"type":"speak","text":"hi","\\udfff":1}'),
        st.integers(100, 70000).map(lambda n: b'{"type":"speak","text":"' + b"a" * n + b'"}'),
    ).map(lambda b: b.replace(b"\n", b" "))


@settings(max_examples=400, deadline=None)
@given(lines())
def test_any_line_parses_to_a_request_or_a_bad_request_error(line):
    try:
        parse_line(line, 65536)
    except ApplianceError as e:
        ev = error_event(e)
        assert ev.code in ("bad_request", "bad_text", "bad_speaker", "unknown_channel")
        assert json.loads(to_json(ev))["type"] == "error"


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["say", "cancel", "health", "nope"]), st.one_of(lines(), st.binary(max_size=300)))
def test_any_mqtt_payload_becomes_one_request_or_one_error(kind, payload):
    req, err = parse_command(kind, payload, 2048)
    assert (req is None) != (err is None)
    if err is not None:
        assert isinstance(err, ErrorEvent) and json.loads(to_json(err))["code"] == "bad_request"


def test_the_mqtt_bridge_never_raises_on_any_payload(tmp_path):
    from appliance.config import config_from_dict
    from appliance.transports.mqtt import MQTTBridge

    cfg = config_from_dict({"mqtt": {"enabled": True, "port": 1, "max_payload_bytes": 2048}}, base_dir=str(tmp_path))
    handed, errors = [], []
    bridge = MQTTBridge(cfg, lambda req, sink: handed.append(req), lambda: None)
    bridge.sink = lambda ev: errors.append(ev)          # no broker here: record instead

    @settings(max_examples=300, deadline=None)
    @given(st.sampled_from(["say", "cancel", "health"]), st.one_of(lines(), st.binary(max_size=300)), st.booleans())
    def run(kind, payload, retained):
        n = len(handed) + len(errors)
        bridge._command(f"chattts/appliance/{kind}", payload, retained)
        assert len(handed) + len(errors) - n <= 1          # one outcome (0: a duplicate say id, dropped)
    run()


@pytest.fixture(scope="module")
def daemon(tiny_ckpt, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    cfg = service_config(tiny_ckpt, tmp, synthesis={"max_new_tokens": 8},
                         service={"max_line_bytes": 65536, "channels": [{"name": "main", "queue_len": 64}]},
                         safety={"max_requests_per_s": 0}, health={"at_start": False, "sentence": "你好"})
    d = launch_daemon(tmp / "d", cfg)
    yield d
    assert d.stop() == 0, d.log()[-3000:]


TERMINAL = {"done", "error", "status", "health"}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(line=lines().filter(lambda b: b.strip()))      # a blank line is skipped by design (no answer)
def test_the_daemon_answers_every_line_with_a_terminal_event(daemon, line):
    c = daemon.connect(timeout_s=30)
    try:
        c.send(line)
        evs = c.events(tuple(TERMINAL))
    finally:
        c.close()
    assert evs and evs[-1]["type"] in TERMINAL, (line[:200], evs)
    if evs[-1]["type"] == "error":
        assert evs[-1]["code"] != "internal", (line[:200], evs[-1])


def test_the_daemon_is_still_serving_after_the_fuzz(daemon):
    """Runs after the fuzz above (same module-scoped daemon)."""
    (st_,) = daemon.request({"type": "status"})
    assert st_["state"] == "ready"
    evs = daemon.request({"type": "speak", "text": "还在工作。", "seed": 1})
    assert evs[-1]["type"] == "done", evs
    log = daemon.log()
    assert "Traceback" not in log and "Exception in callback" not in log, log[-3000:]


@pytest.mark.parametrize("rid", ["a\x00b", "line\nbreak", "esc\x1b[31m", "c1\x85"])
def test_a_request_id_with_control_characters_is_refused(rid):
    """Ids reach log lines and file names: control characters in one get a bad_request."""
    with pytest.raises(ApplianceError, match="control characters"):
        parse_line(json.dumps({"type": "speak", "text": "hi", "id": rid}).encode())
    assert parse_line(json.dumps({"type": "speak", "text": "hi", "id": "ok-id_1.2"}).encode()).id == "ok-id_1.2"
