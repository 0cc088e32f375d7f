"""Testing helpers for rdmaio.

:mod:`rdmaio.testing.host` runs a command on a host that has an RDMA device: this machine when it has
one, otherwise a throwaway virtual machine with Soft-RoCE (``rdma_rxe``) booted by virtme-ng.

:mod:`rdmaio.testing.fakes` holds the in-memory stand-ins the unit tests run on instead of a device: fake
verbs objects (queue pair, cm id, channels, CQs, device, memory regions and windows), a fake core backend
and transport, and a fake Endpoint for the compatibility layers.
"""
