"""Command-line tools of rdmaio: ``doctor`` (why RDMA does or does not work here) and ``ping``.

Both are reached through ``python -m rdmaio COMMAND`` or the ``rdmaio`` console script.

Modules:

* :mod:`rdmaio.cli.doctor`: the ``doctor`` command (runs the checks, prints one line each, or JSON).
* :mod:`rdmaio.cli.checks`: the checks themselves (libraries, kernel modules, devices, ports, GIDs, limits,
  a loopback connection) and the fix each failure suggests.
* :mod:`rdmaio.cli.system`: what the checks read of this machine (sysfs, ``/proc``, limits), behind one
  object so tests can fake it.
* :mod:`rdmaio.cli.ping`: the ``ping`` command (round trips over rdmaio, a ``min/avg/max/p99`` summary).
* :mod:`rdmaio.cli.peer`: ``doctor --peer HOST [PORT]`` (a pair of hosts, through ``ping --server`` there,
  which answers doctor's probes).
* :mod:`rdmaio.cli.startup`: imported first by ``import rdmaio``; lets the command line run ``doctor`` when
  rdmaio's compiled extension is missing or broken.
* :mod:`rdmaio.cli.perf`: the ``perf`` command (throughput and latency between two hosts: a server and a
  client, six modes, ``--json``).
"""
