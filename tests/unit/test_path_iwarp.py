"""The path record's GIDs on iWARP, natively: rdma_cm leaves an iWARP connection's remote GID (and on the
connecting side its own) all zeros, so the record takes the MAC-based GID of the netdev behind each side's
IP address (the netdev's MAC when the address is this host's, the neighbour table's entry otherwise).
Netlink is only read here: no packet is sent."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from rdmaio.core import path as core_path
from rdmaio.verbs import neighbour
from rdmaio.verbs.path import PathAttributes

MAC = bytes.fromhex("cebaf7cc83aa")
PEER_MAC = bytes.fromhex("52540012abcd")


def attributes(local_gid: bytes, remote_gid: bytes, *, iwarp: bool = True) -> PathAttributes:
    return PathAttributes(
        port=1,
        link_layer="Ethernet",
        iwarp=iwarp,
        local_gid=local_gid,
        remote_gid=remote_gid,
        gid_index=0,
        gid_type="IB",
        active_mtu=1024,
        path_mtu=1024,
    )


def test_a_local_address_is_its_netdevs_mac() -> None:
    lo = bytes.fromhex(Path("/sys/class/net/lo/address").read_text().strip().replace(":", ""))
    assert neighbour.link_address_of("127.0.0.1") == lo
    assert neighbour.link_address_of("::1") == lo


def test_an_address_nobody_here_knows_has_no_mac() -> None:
    assert neighbour.link_address_of("203.0.113.77") is None  # TEST-NET-3: neither ours nor a neighbour
    assert neighbour.iwarp_gid("203.0.113.77") is None
    assert neighbour.link_address_of("not an address") is None


def test_the_iwarp_gid_is_the_mac_then_ten_zero_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(neighbour, "link_address_of", lambda address: MAC)
    assert neighbour.iwarp_gid("198.18.0.1") == MAC + bytes(10)
    assert core_path.format_gid(MAC + bytes(10)) == "ceba:f7cc:83aa::"
    monkeypatch.setattr(neighbour, "link_address_of", lambda address: bytes(20))  # an InfiniBand netdev
    assert neighbour.iwarp_gid("198.18.0.1") is None


def test_malformed_route_attributes_end_the_parse() -> None:
    good = struct.pack("=HH", 8, 1) + b"\x01\x02\x03\x04"
    too_long = struct.pack("=HH", 200, 2) + b"\x00" * 4
    too_short = struct.pack("=HH", 2, 2) + b"\x00" * 4
    assert neighbour._attributes(good + too_long, 0, len(good + too_long)) == {1: b"\x01\x02\x03\x04"}
    assert neighbour._attributes(good + too_short, 0, len(good + too_short)) == {1: b"\x01\x02\x03\x04"}


def test_iwarp_gids_fill_what_rdma_cm_left_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: the connecting side's record read ``:: -> ::`` and the accepting side's remote GID ``::``."""
    macs = {"198.18.0.1": MAC, "198.18.0.2": PEER_MAC}
    monkeypatch.setattr(core_path, "iwarp_gid", lambda ip: macs[ip] + bytes(10) if ip in macs else None)
    zero = bytes(16)
    # connecting side: both zero
    assert core_path.iwarp_gids(attributes(zero, zero), "198.18.0.1", "198.18.0.2") == (
        MAC + bytes(10),
        PEER_MAC + bytes(10),
    )
    # accepting side: the device read its own GID; it is kept
    own = bytes.fromhex("11223344556600000000000000000000")
    assert core_path.iwarp_gids(attributes(own, zero), "198.18.0.2", "198.18.0.1") == (own, MAC + bytes(10))
    # a peer nobody here knows stays zero (the record then says ::)
    assert core_path.iwarp_gids(attributes(own, zero), "198.18.0.2", "203.0.113.9") == (own, zero)
    assert core_path.iwarp_gids(attributes(zero, zero), None, None) == (zero, zero)
