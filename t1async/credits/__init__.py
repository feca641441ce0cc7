"""Credits: the ledger that bounds policy staleness, the credit server and client, settlement, liveness.

Glossary (one word a thing; design §7):

- **credit**: leave to sample one turn of one episode. An actor asks for it before each turn
  (``client.CreditClient``), the learner's ledger grants it when the staleness rule allows
  (``ledger.CreditLedger``, which keeps one ``ledger.Credit`` a credit), and the turn's delivery spends it.
- **request**: an actor's ask for credits on ``t1.credit`` (``wire.CreditRequest``: actor, episode, turn). A
  request the ledger cannot grant yet is *held* (``server.CreditServer``): that wait is the backpressure.
- **gate** (``ledger.CreditGate``): the ledger under anyio: ``acquire`` waits until a credit can be granted
  (and grants nothing while the gate is held: η = 0 during a step).
- **grant**: the learner's answer to one request (``wire.CreditGrant``): ``granted`` credits given together
  under one ``grant_id``, with the version the samplers served then and the lease. A retried request for
  a turn already granted gets the same grant back.
- **lease**: how long a granted credit stays good undelivered (``lease_s``, the learner's ``--lease``).
  A credit whose lease runs out *expires*: it is released.
- **release**: the ledger takes running credits back before delivery (their lease ran out, their actor went
  silent, their episode ended): their capacity goes back to the actors at once.
- **credit states** (``ledger.CreditState``): ``running`` (granted, not delivered), ``delivered`` (its turn
  arrived, not yet settled), ``settled``, ``expired`` (released undelivered).
- **settle**: the end of a delivered credit, once, with a ``ledger.SettleReason`` (``trained``,
  ``stale_masked``, ``realign_dropped``, ``poisoned``, ``abandoned``; ``settle.py`` says when each applies).
  Only ``trained`` keeps the credit in ``accepted``; the others give its capacity back.
- **accepted**, **capacity**, **rank**, **deadline**, **due**: the admission rule and training order, as
  defined in ``ledger.py``.
- **unadmitted**: a delivered turn with no live credit (its credit expired or was released, or it never
  asked); the learner trains it only if it is within the staleness bound.
- **liveness**: heartbeats and credit requests say an actor is alive (``liveness.ActorLiveness``); a silent
  actor's credits are released.
"""

# This package imports nothing (its modules stay light to import): import the modules directly.
__all__: list[str] = []
