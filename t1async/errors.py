"""The t1async error tree.

    T1Error                      base of everything t1async raises on purpose
    ├── WireError                a message failed validation (bad bytes, bad field): the sender's fault
    ├── TransportError           the message bus misbehaved or is unreachable: the world's fault
    ├── SamplerError             a sampler answered badly or could not be reached
    │   ├── SamplerRequestError  the sampler rejected our request (HTTP 400): our fault
    │   └── SamplerVersionError  the sampler reports a weight_version that is not an integer: its setup's fault
    ├── SandboxError             a sandbox could not start or died
    ├── ConfigError              a bad flag, file or setting: the user's fault
    └── ServerStartError         an embedded server (nats-server, sampler) failed to start

Each error puts the offending values in its message and says what to do, where that is known.
"""

from __future__ import annotations


class T1Error(Exception):
    """Base class for every error t1async raises on purpose."""


class WireError(T1Error):
    """A message failed to decode or validate. ``field`` names the offending field ('' for the envelope)."""

    def __init__(self, message: str, *, field: str = "", reason: str = "invalid") -> None:
        super().__init__(message)
        self.field = field
        self.reason = reason  # short token used for the dead-letter subject t1.dead.<reason>


class TransportError(T1Error):
    """The message transport failed (server unreachable, stream missing, publish not acknowledged)."""


class SamplerError(T1Error):
    """A sampler could not be reached, or answered with something we cannot use."""


class SamplerRequestError(SamplerError):
    """A request a sampler rejects as invalid (HTTP 400): what the client raises on a 400, and what the
    embedded server's validation (sampler/protocol.py) raises, with ``param`` naming the offending field."""

    def __init__(self, message: str, *, param: str = "") -> None:
        super().__init__(message)
        self.param = param


class SamplerVersionError(SamplerError):
    """A sampler reported a ``weight_version`` that is not a non-negative integer (a real SGLang server says
    ``"default"`` until one is set): staleness is computed from it, so it is never silently defaulted (§7)."""


class SandboxError(T1Error):
    """A sandbox could not start, or died under us."""


class ConfigError(T1Error):
    """A bad flag, config file or setting."""


class ServerStartError(T1Error):
    """An embedded server (nats-server, the sampler) failed to start."""
