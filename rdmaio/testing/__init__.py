"""Testing helpers for rdmaio.

:mod:`rdmaio.testing.host` runs a command on a host that has an RDMA device: this machine when it has
one, otherwise a throwaway virtual machine with Soft-RoCE (``rdma_rxe``) booted by virtme-ng.
"""
