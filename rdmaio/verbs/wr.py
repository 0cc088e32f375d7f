"""The ``wr_id`` layout of every work request rdmaio posts (kind, connection tag, index)."""

from __future__ import annotations

import struct

from rdmaio._ffi import ffi, lib

# --- wr_id layout ------------------------------------------------------------------------------------
# Every work request rdmaio posts carries, in its 64-bit wr_id: bits 56..63 the operation kind, bits 32..55
# the 24-bit connection tag its Domain assigned, bits 0..31 the index (slot number, op number). A
# completion is dispatched to its connection by dispatch_key(wc.qp_num, tag): QP numbers are reused once a
# QP is destroyed, and the tag keeps a destroyed QP's late completions (rxe may leave some in a shared CQ)
# away from a new connection that got the same QP number. The C helper (helper.h) uses the same layout.

WR_KIND_SEND = 0
"""wr_id kind: a send slot (index = send slot number)."""
WR_KIND_RECV = 1
"""wr_id kind: a receive slot (index = receive slot number)."""
WR_KIND_ONESIDED = 2
"""wr_id kind: a one-sided operation (index = operation number)."""
WR_KIND_CONTROL = 3
"""wr_id kind: a control or keepalive work request."""
WR_KIND_SHIFT = 56
WR_TAG_SHIFT = 32
WR_TAG_BITS = 24
WR_TAG_MASK = (1 << WR_TAG_BITS) - 1
"""Largest connection tag (tags are 24 bits)."""
WR_INDEX_MASK = 0xFFFFFFFF
"""``wr_id & WR_INDEX_MASK`` is the index (slot or operation number)."""
MAX_POLL: int = lib.RDMAIO_MAX_POLL
"""The largest batch :meth:`CompletionQueue.poll_grouped` takes in one call."""


def make_wr_id(kind: int, tag: int, index: int) -> int:
    """The wr_id of a work request of ``kind`` (``WR_KIND_*``) on the connection ``tag`` at ``index``."""
    if not 0 <= kind <= 0xFF or not 0 <= tag <= WR_TAG_MASK or not 0 <= index <= WR_INDEX_MASK:
        raise ValueError(f"wr_id field out of range: kind={kind} tag={tag} index={index}")
    return (kind << WR_KIND_SHIFT) | (tag << WR_TAG_SHIFT) | index


def wr_kind(wr_id: int) -> int:
    """The operation kind (``WR_KIND_*``) of a wr_id."""
    return wr_id >> WR_KIND_SHIFT


def wr_tag(wr_id: int) -> int:
    """The connection tag of a wr_id."""
    return (wr_id >> WR_TAG_SHIFT) & WR_TAG_MASK


def wr_index(wr_id: int) -> int:
    """The index (slot or operation number) of a wr_id."""
    return wr_id & WR_INDEX_MASK


def dispatch_key(qp_num: int, tag: int) -> int:
    """The key completions are dispatched by: ``(qp_num << 24) | tag`` (what ``poll_grouped`` groups)."""
    return (qp_num << WR_TAG_BITS) | tag


# --- one-sided request layout ---------------------------------------------------------------------------
RDMA_OP = struct.Struct("=QQIIIIIIQQQ")
"""``struct rdmaio_rdma_op`` (helper.h) as one ``pack_into``: ``wr_id, local_addr, length, lkey, opcode,
send_flags, imm_data, rkey, remote_addr, compare_add, swap``. Writing an entry with one C call instead
of eleven cffi attribute stores is most of the cost of filling it (the one-sided engine fills one per
request)."""


def _check_rdma_op_layout() -> None:
    # The layout must match the compiled struct exactly, field by field (no padding in either).
    fields = (
        "wr_id",
        "local_addr",
        "length",
        "lkey",
        "opcode",
        "send_flags",
        "imm_data",
        "rkey",
        "remote_addr",
        "compare_add",
        "swap",
    )
    offsets = [ffi.offsetof("struct rdmaio_rdma_op", name) for name in fields]
    expected, at = [], 0
    for code in RDMA_OP.format[1:]:
        expected.append(at)
        at += struct.calcsize("=" + code)
    if offsets != expected or ffi.sizeof("struct rdmaio_rdma_op") != RDMA_OP.size:
        raise ImportError(f"struct rdmaio_rdma_op layout {offsets} does not match RDMA_OP {expected}")


_check_rdma_op_layout()
