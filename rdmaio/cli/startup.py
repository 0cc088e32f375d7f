"""The command line's way around a compiled extension that does not load.

``import rdmaio`` loads rdmaio's compiled cffi extension (``rdmaio/_rdmaio_cffi*.so``) through the public
modules, and both ``python -m rdmaio COMMAND`` and the ``rdmaio`` console script import the package before
any command runs. A missing or broken extension would therefore end every command, ``doctor`` included, in a
traceback: exactly when a new user needs ``doctor`` to say what is wrong.

``rdmaio/__init__.py`` imports this module first. Importing it does nothing (and programs that ``import
rdmaio`` see no difference) unless this process is rdmaio's command line **and** the extension does not
load; then it runs the command without the extension (``doctor`` and the help; any other command prints
one line naming the problem and pointing at ``doctor``) and exits with the command's status, before the
package's public modules are imported.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

__all__ = ["EXTENSION_FIX", "extension_error", "invoked_as_cli", "run_without_extension"]

EXTENSION_MODULE = "rdmaio._rdmaio_cffi"
EXTENSION_FIX = (
    "rebuild it: from a checkout, tools/dev setup; an installed rdmaio: "
    "apt-get install gcc python3-dev libibverbs-dev librdmacm-dev && "
    "pip install --force-reinstall --no-binary rdmaio rdmaio"
)
"""What to do when the extension does not load (it is compiled against rdma-core's headers)."""

# The interpreter's short options that take a value (``-X dev``, ``-W error``): their value is not a command.
_OPTIONS_WITH_VALUE = frozenset("XW")


def _module_of(orig_argv: Sequence[str]) -> str | None:
    """The module an interpreter command line runs with ``-m`` (None for a script, ``-c`` or a REPL)."""
    args = iter(orig_argv[1:])
    for arg in args:
        if arg == "--" or not arg.startswith("-") or arg == "-":
            return None  # a script (or stdin): no -m before it
        if arg.startswith("--"):
            if arg == "--check-hash-based-pycs":
                next(args, None)
            continue
        flags = arg[1:]
        for i, flag in enumerate(flags):
            if flag == "m":
                return flags[i + 1 :] or next(args, None)
            if flag == "c":
                return None
            if flag in _OPTIONS_WITH_VALUE:
                if not flags[i + 1 :]:
                    next(args, None)
                break
    return None


def invoked_as_cli(orig_argv: Sequence[str] | None = None, argv0: str | None = None) -> bool:
    """Whether this process is rdmaio's command line: ``python -m rdmaio ...`` or the ``rdmaio`` script.

    ``orig_argv`` defaults to :data:`sys.orig_argv` (the interpreter's own command line), ``argv0`` to
    ``sys.argv[0]`` (the console script's path).
    """
    orig = sys.orig_argv if orig_argv is None else orig_argv
    if _module_of(orig) == "rdmaio":
        return True
    first = (sys.argv[0] if sys.argv else "") if argv0 is None else argv0
    return os.path.basename(first) == "rdmaio"


def extension_error() -> ImportError | None:
    """Why rdmaio's compiled extension does not load, or None when it does."""
    try:
        __import__(EXTENSION_MODULE)
    except ImportError as exc:
        return exc
    return None


def describe_extension_error(error: ImportError) -> str:
    """One line: the extension is missing (never built) or present but broken, and why."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if isinstance(error, ModuleNotFoundError) and error.name == EXTENSION_MODULE:
        return f"rdmaio's compiled extension is missing: no _rdmaio_cffi*.so in {package}"
    return f"rdmaio's compiled extension does not load: {error}"


def run_without_extension(args: Sequence[str], error: ImportError) -> int:
    """Run the command ``args`` (what follows ``rdmaio``) when the extension does not load.

    ``doctor`` and the help run as usual (doctor's ``extension`` check reports the problem with its fix
    and the checks that need the extension are skipped); every other command needs the extension, so it
    prints one line saying so and returns 1.
    """
    command = args[0] if args else None
    if command in (None, "-h", "--help", "help", "doctor"):
        from rdmaio.__main__ import main

        return main(args)
    print(
        f"rdmaio {command}: {describe_extension_error(error)}\n"
        f"rdmaio {command}: {EXTENSION_FIX}; python -m rdmaio doctor checks the rest",
        file=sys.stderr,
    )
    return 1


def _guard() -> None:
    if not invoked_as_cli():
        return
    error = extension_error()
    if error is not None:
        sys.exit(run_without_extension(sys.argv[1:], error))


_guard()
