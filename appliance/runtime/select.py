"""Choose the inference backend once, at load, and say why.

``open_runner(cfg)`` returns a :class:`~appliance.runtime.runner.Runner`. ``model.backend``
``auto`` picks, in order: ``tensorrt`` (plans built for this device and a GPU present),
``torch`` on CUDA (torch importable and a GPU present), ``onnxruntime`` (exported graphs
present), else ``torch`` on CPU. The choice and its reason are logged and stored in
``runner.info.reason``.
"""

from __future__ import annotations

import logging

from ..config import Config
from ..errors import ConfigError
from .runner import Runner

log = logging.getLogger(__name__)


def open_runner(cfg: Config) -> Runner:
    """Load the configured backend and return its runner.

    Raises:
        ConfigError: the requested backend is not installed or not usable here.
        CheckpointError: the checkpoint is missing or malformed.
    """
    backend = cfg.model.backend
    if backend in ("auto", "torch"):
        try:
            from .torch_runner import TorchRunner
        except ImportError as e:  # torch missing
            raise ConfigError(f"model.backend={backend} needs PyTorch: pip install 'chattts-appliance[torch]' ({e})") from e
        reason = "torch backend requested" if backend == "torch" else "auto: no other backend available yet"
        runner = TorchRunner(cfg, reason=reason)
    else:
        raise ConfigError(f"model.backend={backend} is not available in this build")
    log.info("inference backend: %s (%s)", runner.info.backend, runner.info.reason)
    return runner
