"""Testing helpers for rdmaio.

Modules:

* :mod:`rdmaio.testing.host` (a package, one module per job) runs a command on a host that has an RDMA
  device: this machine when it has one, otherwise a throwaway virtual machine with Soft-RoCE
  (``rdma_rxe``) booted by virtme-ng (``python -m rdmaio.testing.host -- CMD``).
* :mod:`rdmaio.testing.pair` is the test host's two-node topology (``--topology pair``): two rxe devices
  joined by a veth pair, for fault injection on a real netdev.
* :mod:`rdmaio.testing.skips` is the rule the device suites share: where a suite must really run, a
  skipped test is a failed one.
* :mod:`rdmaio.testing.fakes` holds the in-memory stand-ins the unit tests run on instead of a device:
  fake verbs objects (queue pair, cm id, channels, CQs, device, protection domain, memory regions and
  windows), a fake core backend, transport and reactor, and a fake Endpoint for the compatibility layers.
* :mod:`rdmaio.testing.nullpair` is a connected pair of real Endpoints over a null device built on those
  fakes (sends land in the peer one loop iteration later, one-sided requests run on real memory), made
  directly or through the server's real accept path, with a meter of the device's own CPU time (the native
  overhead benchmark, ``python -m bench --overhead``, and the Python-call budgets use it).
"""
