"""Hostile peers for the integration tests: ordinary rdmaio endpoints made to do what rdmaio never does.

Every helper reaches into the internals of an :class:`rdmaio.Endpoint` (its connection ``ep._conn``, send
engine, one-sided and rendezvous engines) of the *attacking* side only, so the side under test runs
unmodified code. Nothing here is used by rdmaio itself.

Rendezvous (zero-copy) helpers:

* :func:`export_region` registers a buffer of the attacker for remote READ, which forged descriptors can
  point at (many descriptors may point at the same bytes: the victim pulls them again and again);
* :func:`forge_rndv` puts an RNDV frame with any descriptor on the wire, in the order of the attacker's
  send queue and as its credits allow (as ``RendezvousEngine.send`` queues its own);
* :func:`record_rndv_answers` makes the attacker take the victim's answers (DONE/WITHDRAWN) to forged
  descriptors without failing its connection over them, and records them;
* :func:`never_answer_rndv` turns an endpoint into a rendezvous receiver that records the descriptors it
  is sent and never pulls, answers or withdraws them, not even after a CANCEL: the sender's buffer stays
  registered and readable by it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import rdmaio
from rdmaio import verbs
from rdmaio.protocol.rendezvous import CTL_CANCEL, CTL_DONE, CTL_WITHDRAWN, Descriptor

__all__ = [
    "CTL_CANCEL",
    "CTL_DONE",
    "CTL_WITHDRAWN",
    "Answers",
    "Silent",
    "export_region",
    "forge_rndv",
    "forge_rndv_many",
    "never_answer_rndv",
    "record_rndv_answers",
]


def export_region(ep: rdmaio.Endpoint, data: bytes | bytearray) -> verbs.MemoryRegion:
    """A copy of ``data`` registered on ``ep``'s protection domain for remote READ (close it when done)."""
    return verbs.MemoryRegion(ep._conn.transport.pd, bytearray(data), remote_read=True)


def forge_rndv(ep: rdmaio.Endpoint, desc: Descriptor) -> None:
    """Queue one RNDV frame carrying ``desc`` on ``ep``'s send queue; it is posted as credits allow."""
    ep._conn.sender.queue_rndv(bytearray(desc.encode()))


def forge_rndv_many(
    ep: rdmaio.Endpoint, region: verbs.MemoryRegion, count: int, length: int, first_id: int = 1 << 40
) -> list[int]:
    """Announce ``count`` messages of ``length`` bytes, all of them the start of ``region``; return their
    message ids (from ``first_id`` on: far from the ids of the endpoint's own sends)."""
    if length > region.length:
        raise ValueError(f"{length} bytes announced from a region of {region.length}")
    ids = list(range(first_id, first_id + count))
    for msg_id in ids:
        forge_rndv(ep, Descriptor(msg_id, region.addr, length, region.rkey))
    return ids


@dataclass
class Answers:
    """The rendezvous answers an attacker received: ``(kind, msg_id)`` in arrival order."""

    received: list[tuple[int, int]] = field(default_factory=list)

    def count(self, kind: int) -> int:
        """How many answers of ``kind`` (``CTL_DONE``, ``CTL_WITHDRAWN``) came."""
        return sum(1 for k, _ in self.received if k == kind)


def record_rndv_answers(ep: rdmaio.Endpoint) -> Answers:
    """Make ``ep`` record the answers to descriptors it forged instead of failing on them (an answer for a
    message it did not send is a protocol error for rdmaio); answers to its own sends still go through."""
    rndv = ep._conn.rndv
    assert rndv is not None, "rendezvous was not negotiated"
    answers = Answers()
    original = rndv.on_control

    def on_control(kind: int, msg_id: int) -> None:
        if kind in (CTL_DONE, CTL_WITHDRAWN) and msg_id not in rndv.sends.active:
            answers.received.append((kind, msg_id))
            return
        original(kind, msg_id)

    ep._conn.onesided.control_handler = on_control
    return answers


@dataclass
class Silent:
    """What a :func:`never_answer_rndv` receiver saw: the descriptors (it could READ the sender's buffers
    with them) and the CANCELs it ignored."""

    descriptors: list[Descriptor] = field(default_factory=list)
    cancels: list[int] = field(default_factory=list)


def never_answer_rndv(ep: rdmaio.Endpoint) -> Silent:
    """Make ``ep`` record every rendezvous descriptor it is sent and never pull, answer or withdraw it (a
    CANCEL is recorded and ignored); its other traffic works as usual."""
    rndv = ep._conn.rndv
    assert rndv is not None, "rendezvous was not negotiated"
    silent = Silent()
    original = rndv.on_control
    max_size = ep._conn.options.max_message_size

    def on_request(payload: Any) -> None:
        silent.descriptors.append(Descriptor.decode(payload, max_size))

    def on_control(kind: int, msg_id: int) -> None:
        if kind == CTL_CANCEL:
            silent.cancels.append(msg_id)
            return
        original(kind, msg_id)

    rndv.on_request = on_request  # type: ignore[method-assign]
    ep._conn.onesided.control_handler = on_control
    return silent
