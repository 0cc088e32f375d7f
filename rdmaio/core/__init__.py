"""The core layer: what one event loop shares and what each connection owns, between the sans-IO protocol
and the public API.

* :mod:`~rdmaio.core.backend`: the event-loop backends (asyncio and uvloop; trio).
* :mod:`~rdmaio.core.reactor`: per loop, the rdma_cm event channel and async-event routing; the domains.
* :mod:`~rdmaio.core.domain`: per device and loop, the protection domain, the registration cache, the
  ring-memory pool and the completion dispatcher; the device's settings (``max_pinned``).
* :mod:`~rdmaio.core.dispatch`: the shared CQs on one completion channel, dispatched per connection.
* :mod:`~rdmaio.core.rings`: slot rings registered chunk by chunk, and their pool.
* :mod:`~rdmaio.core.transport`: one connection's verbs resources (QP, rings, CQ reservation) and their
  teardown order.
* :mod:`~rdmaio.core.dial`: connection setup on the connecting side: resolve, resources, depths,
  handshake, session choice, to a started Connection.
* :mod:`~rdmaio.core.acceptor`: connection setup on the listening side: listeners, admission (backlog,
  per-source limit), pending connections and their establishment deadline, handshake, session choice.
* :mod:`~rdmaio.core.port_retry`: when a connect or a listen draws another port (Soft-iWARP's TCP still
  holding the one rdma_cm picked).
* :mod:`~rdmaio.core.negotiation`: the handshakes both sides of setup announce.
* :mod:`~rdmaio.core.capabilities`: what a device offers (immediate data, atomics, windows, inline size),
  announced in the handshake; the framing follows from both sides'.
* :mod:`~rdmaio.core.resolver`: host names to the numeric addresses rdma_cm takes.
* :mod:`~rdmaio.core.connection`: one connection's parts, the demultiplexing of its completions, its
  lifetime (close, failure, teardown, rdma_cm and async events).
* :mod:`~rdmaio.core.send`: the sender - the send calls, the send queue's owner, every post of a frame.
* :mod:`~rdmaio.core.receive`: the receiver - received frames, the read calls, every re-post of a receive.
* :mod:`~rdmaio.core.rendezvous`: zero-copy large messages (RDMA READ by the receiver).
* :mod:`~rdmaio.core.keepalive`: idle-connection probes.
* :mod:`~rdmaio.core.onesided`: one-sided RDMA, a package: remote keys, the operation engine, the
  exporter (grants, revocation, write notices) and the facade each connection holds.
* :mod:`~rdmaio.core.shared_receive`: per device and loop, the optional shared receive queue (its buffers,
  its credit ledger) and each connection's place on it.
* :mod:`~rdmaio.core.path`: the path record of a connection (``get_extra_info("rdma")``), read on request.
* :mod:`~rdmaio.core.metrics`: the process's connection registry behind :mod:`rdmaio.metrics` (connections
  registered at setup, their counters folded in at teardown, failures counted where they are raised).

The core imports the verbs layer, the protocol, :mod:`rdmaio.options` and :mod:`rdmaio.errors`, and reaches
C only through the verbs layer (its objects, or ``ffi``/``lib`` from :mod:`rdmaio.verbs.native`, checked by
tests/unit/test_layers.py); nothing in it imports the public API.
"""
