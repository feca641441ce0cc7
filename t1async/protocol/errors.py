"""The t1async error tree. The classes defined here are the branches; the leaves live beside the code that
raises them (module in brackets).

    T1Error                          base of everything t1async raises on purpose
    ├── WireError                    a message failed validation (bad bytes, bad field): the sender's fault
    │   └── ChunkError               [transport.chunking] a chunked record's pieces contradict or expired
    ├── TransportError               the message bus misbehaved or is unreachable: the world's fault
    │   ├── TransportClosedError     [transport.base] used after its `async with` ended: the caller's bug
    │   ├── RequestTimeoutError      [transport.base] no reply in time (the server may hold it): retry
    │   └── NoRespondersError        [transport.base] nobody serves the subject yet: retry later
    ├── SamplerError                 a sampler answered badly or could not be reached
    │   ├── SamplerRequestError      the sampler rejected our request (HTTP 400): our fault
    │   ├── SamplerVersionError      its weight_version is not an integer: its setup's fault
    │   ├── SamplerClosedError       [sampler.client] used after close: the caller's bug
    │   └── SamplerUnreachableError  [sampler.client] every attempt failed to reach it: it is down
    ├── SandboxError                 a sandbox could not start or died
    │   ├── SandboxStartError        [sandbox_agent.sandbox.base] it could not start
    │   │   └── ImageError           [sandbox_agent.images.build] an image could not be built or resolved
    │   │       └── ImageBuildError      [sandbox_agent.images.build] a task's image did not build (image_build_failed)
    │   ├── SandboxClosedError       [sandbox_agent.sandbox.base] used after close: the caller's bug
    │   └── SandboxPathError         [sandbox_agent.sandbox.base] a file path outside the work dir
    ├── ConfigError                  a bad flag, file or setting: the user's fault
    │   ├── TaskFormatError          [sandbox_agent.tasks.task] a task directory that does not load
    │   └── PushCheckError           [learner.pushcheck] a sampler does not serve the weights pushed to it
    ├── ServerStartError             an embedded server (nats-server, sampler) failed to start
    ├── AssemblyError                [ingest.tito] turns assembled against their contract: a programming error
    ├── RoutingError                 [ingest.routing] a routing trace that cannot be decoded (bad base64, size, ids)
    ├── BatchError                   [learner.batch] a segment that cannot be trained as given
    ├── JournalClosedError           [ingest.journal] the journal used after close: the caller's bug
    ├── JournalWriteError            [ingest.journal] an append not written or fsynced (a full disk): retry it
    ├── RankFailedError              [learner.distributed] a rank of the distributed learner died
    ├── RankStepError                [learner.distributed] another rank's part of the step raised
    ├── TaskSetupError               [sandbox_agent.agent.runner] a task's setup.sh failed: the task is broken
    └── TaskNeedsImageError          [sandbox_agent.tasks.task] the task needs a container image the backend lacks

Each error puts the offending values in its message and says what to do, where that is known.
"""

from __future__ import annotations

from enum import StrEnum


class T1Error(Exception):
    """Base class for every error t1async raises on purpose."""


class DeadReason(StrEnum):
    """Why a message (or a segment) was dead-lettered: the last token of its subject ``t1.dead.<reason>``, the
    ``T1-Dead-Reason`` header, the key of ``TransportStats.dead`` and the poison file's ``reason``."""

    INVALID = "invalid"  # a WireError that names no better reason
    FIELD = "field"  # a field of the wrong type or value (protocol.fields)
    MISSING = "missing"  # a required field is absent
    SCHEMA = "schema"  # not a msgpack map, or no int schema version
    VERSION = "version"  # an unsupported schema version
    POLICY_VERSION = "policy_version"  # ingest.validate: a token sampled by a policy newer than the learner's
    KIND = "kind"  # an unknown envelope kind
    MSGPACK = "msgpack"  # not valid msgpack, or an ext type the wire does not allow
    CHUNK = "chunk"  # a chunked record's pieces contradict or expired (transport.chunking)
    TOKEN_RANGE = "token_range"  # ingest.validate: a token id >= vocab_size
    LOGPROB = "logprob"  # ... an output logprob that is not finite
    ROUTING_SHAPE = "routing_shape"  # ... a routing trace of the wrong shape
    EXPERT_RANGE = "expert_range"  # ... an expert id >= n_experts
    EXPERT_REPEAT = "expert_repeat"  # ... one (token, layer) names an expert twice
    LENGTH = "length"  # ... longer than max_seq_len
    ASSEMBLY = "assembly"  # a validated record that assembly still failed on: its episode goes whole
    TRAIN_STEP = "train_step"  # a segment a training step failed on


class WireError(T1Error):
    """A message failed to decode or validate. ``field`` names the offending field ('' for the envelope)."""

    def __init__(self, message: str, *, field: str = "", reason: DeadReason = DeadReason.INVALID) -> None:
        super().__init__(message)
        self.field = field
        self.reason = reason  # short token used for the dead-letter subject t1.dead.<reason>


class TransportError(T1Error):
    """The message transport failed (server unreachable, stream missing, publish not acknowledged)."""


class SamplerError(T1Error):
    """A sampler could not be reached, or answered with something we cannot use."""


class SamplerRequestError(SamplerError):
    """A request a sampler rejects as invalid (HTTP 400): what the client raises on a 400, and what the
    embedded server's validation (sampler/requests.py) raises, with ``param`` naming the offending field."""

    def __init__(self, message: str, *, param: str = "") -> None:
        super().__init__(message)
        self.param = param


class SamplerVersionError(SamplerError):
    """A sampler reported a ``weight_version`` that is not a non-negative integer (a real SGLang server says
    ``"default"`` until one is set): staleness is computed from it, so it is never silently defaulted (design §4)."""


class SandboxError(T1Error):
    """A sandbox could not start, or died under us."""


class ConfigError(T1Error):
    """A bad flag, config file or setting."""


class ServerStartError(T1Error):
    """An embedded server (nats-server, the sampler) failed to start."""
