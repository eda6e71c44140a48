"""chattts-appliance: ChatTTS as a systemd-managed speech appliance for edge boxes."""

__version__ = "0.1.0"
