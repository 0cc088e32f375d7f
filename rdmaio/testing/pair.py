"""The test host's two-node topology (``--topology pair``): two rxe devices joined by a veth pair.

Traffic between two addresses of one rxe device never reaches a netdev (rxe short-circuits it), so loss,
delay, partitions and link failures cannot be injected in the default topology. Here each "node" has its
own netdev and rxe device, and every packet between them crosses the veth pair, where ``tc netem``,
``ip link set ... down`` and ``rdma link delete`` act::

    node A: rxe0 on veth0         <== veth pair ==>         node B: rxe1 on veth1
            198.18.0.1, fd00:198:18::1                               198.18.0.2, fd00:198:18::2

Why not two network namespaces: the Debian 12 kernel's rxe (6.1) opens its UDP socket and looks up its
routes in the initial namespace only (namespace support came to rxe much later), so an rxe device whose
netdev sits in another namespace cannot reach anything (checked in the VM: ``RDMA_CM_EVENT_UNREACHABLE``).
Both ends therefore stay in the initial namespace, and policy routing keeps the kernel from delivering
A-to-B traffic internally: the two addresses are removed from the ``local`` routing table (so sending to
the other node's address routes out of one's own veth), and re-declared local only for packets that
*arrive* on their own veth (``ip rule iif vethN lookup 10N``). ``accept_local`` lets each end accept
packets whose source is an address of this same machine, and ``rp_filter`` is off.

Consequences for tests: processes of both nodes run in the same namespace and are told apart by the
address they bind or connect from (a client on node A passes ``local_addr=(198.18.0.1, 0)``); "killing
node B" means stopping its processes (SIGSTOP) and cutting or deleting its link.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["NODES", "Node", "nodes", "setup_script"]


@dataclass(frozen=True)
class Node:
    """One end of the pair."""

    name: str
    """``a`` or ``b``."""
    device: str
    """The rxe device (``rxe0``, ``rxe1``)."""
    netdev: str
    """Its veth (``veth0``, ``veth1``)."""
    addr: str
    """Its IPv4 address."""
    addr6: str
    """Its IPv6 address (a ULA)."""
    table: int
    """The routing table that declares its addresses local for packets arriving on its veth."""


NODES = (
    Node("a", "rxe0", "veth0", "198.18.0.1", "fd00:198:18::1", 100),
    Node("b", "rxe1", "veth1", "198.18.0.2", "fd00:198:18::2", 101),
)
"""Node A and node B (Soft-RoCE; :func:`nodes` gives them for another provider)."""


def nodes(provider: str = "rxe") -> tuple[Node, Node]:
    """Node A and node B with devices of ``provider`` (``rxe0``/``rxe1``, or ``siw0``/``siw1``).

    Soft-iWARP runs over the kernel's TCP, which follows the same routing, so the pair works the same way.
    """
    return (
        replace(NODES[0], device=f"{provider}0"),
        replace(NODES[1], device=f"{provider}1"),
    )


def routing_commands() -> list[str]:
    """``ip -batch -force`` lines that (re)apply the pair's routing; safe to repeat.

    Setting a veth down flushes its routes and setting it up puts its addresses back into the ``local``
    table, which would make the kernel deliver A-to-B traffic internally again: after a link comes back
    up, run these again (``ip -force -batch -``: a ``del`` of something already gone is not an error).
    """
    a, b = NODES
    lines = []
    for src, dst in ((a, b), (b, a)):
        lines += [
            f"route replace {dst.addr}/32 dev {src.netdev} src {src.addr}",
            f"route replace {dst.addr6}/128 dev {src.netdev} src {src.addr6}",
        ]
    for n in NODES:
        lines += [
            f"route del local {n.addr} table local",
            f"route del local {n.addr6} table local",
            f"route replace local {n.addr} dev {n.netdev} table {n.table}",
            f"route replace local {n.addr6} dev {n.netdev} table {n.table}",
        ]
    return lines


def setup_script(provider: str = "rxe") -> str:
    """Bash lines that build the pair (run as root in the VM, after the provider's module is loaded), with
    a device of ``provider`` (``rxe`` or ``siw``) on each veth.

    Each failing command calls ``fail`` (defined by the guest script). The order matters: a route with
    ``src`` must be added while that source is still a local address, i.e. before the local routes go.
    """
    a, b = nodes(provider)
    lines = [
        "sysctl -qw net.ipv4.conf.all.accept_local=1 net.ipv4.conf.all.rp_filter=0 "
        "net.ipv4.conf.default.rp_filter=0 net.ipv4.conf.default.accept_local=1 "
        # IPv6 would drop the static addresses of a veth set down (a port flap would lose its GID)
        "net.ipv6.conf.all.keep_addr_on_down=1 net.ipv6.conf.default.keep_addr_on_down=1 >/dev/null "
        '|| fail "sysctl for the pair topology failed"',
        "ip -batch - <<'EOF_IP' || fail \"ip: cannot set up the veth pair\"",
        f"link add {a.netdev} type veth peer name {b.netdev}",
    ]
    for n in NODES:
        lines += [
            f"addr add {n.addr}/32 dev {n.netdev}",
            # noprefixroute: IPv6 would otherwise route the address's own /128 through its own veth
            f"addr add {n.addr6}/128 dev {n.netdev} nodad noprefixroute",
            f"link set {n.netdev} up",
        ]
    for src, dst in ((a, b), (b, a)):
        lines += [
            f"route add {dst.addr}/32 dev {src.netdev} src {src.addr}",
            f"route add {dst.addr6}/128 dev {src.netdev} src {src.addr6}",
        ]
    for n in NODES:
        lines += [
            f"route del local {n.addr} table local",
            f"route del local {n.addr6} table local",
            f"route add local {n.addr} dev {n.netdev} table {n.table}",
            f"route add local {n.addr6} dev {n.netdev} table {n.table}",
            f"rule add pref {n.table} iif {n.netdev} lookup {n.table}",
        ]
    # ip infers the family from the address everywhere above, but a rule has none: a second batch.
    lines += ["EOF_IP", "ip -6 -batch - <<'EOF_IP6' || fail \"ip: cannot add the IPv6 rules\""]
    lines += [f"rule add pref {n.table} iif {n.netdev} lookup {n.table}" for n in NODES]
    lines.append("EOF_IP6")
    if provider == "siw":
        # siw listens and connects with kernel TCP sockets bound to the node's address, which the local
        # table no longer declares local: bind() would fail with EADDRNOTAVAIL (rxe binds no socket).
        lines.append(
            "sysctl -qw net.ipv4.ip_nonlocal_bind=1 net.ipv6.ip_nonlocal_bind=1 >/dev/null "
            '|| fail "sysctl ip_nonlocal_bind for siw failed"'
        )
    for n in (a, b):
        lines.append(
            f"sysctl -qw net.ipv4.conf.{n.netdev}.accept_local=1 net.ipv4.conf.{n.netdev}.rp_filter=0 "
            f'>/dev/null || fail "sysctl for {n.netdev} failed"'
        )
        lines.append(
            f"rdma link add {n.device} type {provider} netdev {n.netdev} "
            f'|| fail "rdma link add {n.device} type {provider} netdev {n.netdev} failed"'
        )
    return "\n".join(lines)
