"""Named voices (config ``voices``): one table read the same way for every transport, resolved by
the pipeline, so ``"voice": "calm"`` is ``seed:11`` wherever it comes from; an unknown name is
refused naming what the box offers; the label ``done`` reports."""

from __future__ import annotations

import numpy as np
import pytest

from appliance.config import VoiceConfig, config_from_dict
from appliance.core import SynthesisRequest
from appliance.errors import ConfigError, SpeakerError
from appliance.text.voices import VoiceBook

BOOK = VoiceBook([VoiceConfig("default"), VoiceConfig("calm", "seed:11"), VoiceConfig("anna", "seed:7")])


def test_names_strings_and_the_default():
    assert BOOK.names == ["default", "calm", "anna"]
    assert BOOK.lookup("calm", "seed:2") == ("seed:11", "calm")
    assert BOOK.lookup("default", "seed:2") == ("seed:2", "default")          # no voice: synthesis.voice
    assert BOOK.lookup(None, "seed:2") == ("seed:2", "default")               # absent: named after its preset
    assert BOOK.lookup(None, "seed:7") == ("seed:7", "default")               # the first entry standing for it
    assert BOOK.lookup("seed:11", "seed:2") == ("seed:11", "seed:11")         # strings still work as before
    assert BOOK.lookup("none", "seed:2") == ("none", "none")
    spk = "\u4e00\u4e01\u4e02"                                                # base16384 text is not ASCII
    choice = BOOK.lookup(spk, "seed:2")
    assert choice.spec == spk and choice.label.startswith("speaker:") and len(choice.label) == 20
    no_default = VoiceBook([VoiceConfig("calm", "seed:11")])
    assert no_default.lookup(None, "seed:2").label == "seed:2"                # no name stands for it


@pytest.mark.parametrize("name", ["clam", "Calm", "calm voice", "", "seed"])
def test_an_unknown_name_is_refused_naming_what_the_box_offers(name):
    with pytest.raises(SpeakerError) as e:
        BOOK.lookup(name, "seed:2")
    assert str(e.value).startswith(f"unknown voice {name!r}; this box offers: default, calm, anna")
    assert e.value.code == "bad_speaker"


@pytest.fixture(scope="module")
def voiced_pipeline(tiny_ckpt, tmp_path_factory):
    from appliance.synth.pipeline import Pipeline
    from tests.fixtures_service import service_config

    tmp = tmp_path_factory.mktemp("voices")
    data = service_config(tiny_ckpt, tmp)
    data["voices"] = [{"name": "default"}, {"name": "calm", "voice": "seed:11"}]
    return Pipeline.from_config(config_from_dict(data, base_dir=str(tmp)))


def test_the_pipeline_resolves_names(voiced_pipeline):
    p = voiced_pipeline
    by_name = p.prepare(SynthesisRequest(text="Hello.", id="a", seed=1, voice="calm"))
    by_string = p.prepare(SynthesisRequest(text="Hello.", id="b", seed=1, voice="seed:11"))
    default = p.prepare(SynthesisRequest(text="Hello.", id="c", seed=1))
    assert np.array_equal(by_name.spk_emb, by_string.spk_emb)
    assert not np.array_equal(by_name.spk_emb, default.spk_emb)
    assert (by_name.voice, by_string.voice, default.voice) == ("calm", "seed:11", "default")
    with pytest.raises(SpeakerError, match="^unknown voice 'clam'; this box offers: default, calm"):
        p.prepare(SynthesisRequest(text="Hello.", id="d", voice="clam"))


def test_a_malformed_named_voice_stops_the_start_naming_it(tiny_ckpt, tmp_path):
    from appliance.synth.pipeline import Pipeline
    from tests.fixtures_service import service_config

    data = service_config(tiny_ckpt, tmp_path)
    data["voices"] = [{"name": "default"}, {"name": "bad", "voice": "seed:x"}]
    with pytest.raises(ConfigError, match=r"^voices\[1\]\.voice: 'seed:x' is not a voice"):
        config_from_dict(data, base_dir=str(tmp_path))      # refused with the config, before the model loads
    data["voices"][1]["voice"] = "\u4e00\u4e01"              # a speaker string that does not decode: at the load
    with pytest.raises(ConfigError, match=r"^voices\[1\] \(bad\): "):
        Pipeline.from_config(config_from_dict(data, base_dir=str(tmp_path)))
