"""Command-line tools of rdmaio: ``doctor`` (why RDMA does or does not work here) and ``ping``.

Both are reached through ``python -m rdmaio COMMAND`` or the ``rdmaio`` console script.
"""
