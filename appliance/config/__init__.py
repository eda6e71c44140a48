"""Configuration: frozen dataclasses (:mod:`.sections`), read and validated by one reader of
``config.yaml`` (:mod:`.loader`) before anything heavy loads. Import names from here."""

from .loader import (
    CONFIG_ENV,
    CONFIG_SEARCH,
    config_from_dict,
    find_config,
    load_config,
    replace,
)
from .sections import (
    AudioConfig,
    ChannelConfig,
    Config,
    HealthConfig,
    JournalConfig,
    ModelConfig,
    MQTTConfig,
    SafetyConfig,
    ServiceConfig,
    StreamConfig,
    SynthesisConfig,
    TelemetryConfig,
    ThrottleConfig,
    VoiceConfig,
    WyomingConfig,
    WyomingVoiceConfig,
    default_device_id,
)

__all__ = ["CONFIG_ENV", "CONFIG_SEARCH", "config_from_dict", "find_config", "load_config", "replace", "ModelConfig", "SynthesisConfig", "StreamConfig", "AudioConfig", "ChannelConfig", "ServiceConfig", "MQTTConfig", "TelemetryConfig", "HealthConfig", "ThrottleConfig", "VoiceConfig", "WyomingVoiceConfig", "WyomingConfig", "default_device_id", "JournalConfig", "SafetyConfig", "Config"]
