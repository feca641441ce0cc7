"""The message transport (design §3, §9): one small interface, a NATS JetStream implementation and an
in-memory one for tests.

    from t1async.transport import NatsTransport, MemoryBroker, MemoryTransport

    async with NatsTransport("nats://127.0.0.1:4222") as t:
        await t.publish(traj_subject(ep), turn_record)              # stored once (Nats-Msg-Id), acked
        async with t.consume("learner") as batches:                   # durable pull consumer on t1.traj.>
            async for batch in batches:
                ...; await batch.ack()
"""

from t1async.transport.base import (
    DEAD_PREFIX,
    TRAJ_STREAM,
    TRAJ_SUBJECTS,
    Batch,
    Delivery,
    Message,
    NoRespondersError,
    Request,
    RequestTimeoutError,
    Transport,
    TransportClosedError,
    TransportStats,
    default_msg_id,
    subject_matches,
    traj_subject,
)
from t1async.transport.memory import MemoryBroker, MemoryTransport
from t1async.transport.nats import NatsTransport
from t1async.transport.natsio import NatsConfig

__all__ = [
    "DEAD_PREFIX",
    "TRAJ_STREAM",
    "TRAJ_SUBJECTS",
    "Batch",
    "Delivery",
    "MemoryBroker",
    "MemoryTransport",
    "Message",
    "NatsConfig",
    "NatsTransport",
    "NoRespondersError",
    "Request",
    "RequestTimeoutError",
    "Transport",
    "TransportClosedError",
    "TransportStats",
    "default_msg_id",
    "subject_matches",
    "traj_subject",
]
