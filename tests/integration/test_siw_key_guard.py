"""Soft-iWARP's refused queue key (``rdmaio.verbs.siw_key_guard``), in a fresh process each time: the
kernel's mmap keys are page offsets of the process's device context, allocated first fit, and libsiw
refuses the queue that starts at page 0x90 (its key is libsiw's invalid-key value) without setting errno.

Without a Domain, one-page CQs fill the context until one lands on that page (its creation fails with
errno 0), and the QP created next lands there too: ``rdma_create_qp`` must raise a ProviderError naming
the cause, not an EIO of rdmaio's making. With a Domain made first (its first CQ is the guard on siw), the
same objects are all created and so is the QP.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.provider("siw")

FILLERS = 400  # one-page CQs: more than the 0x90 pages below the refused key

SCRIPT = r"""
import json, sys
from rdmaio._ffi import ffi, lib
from rdmaio.errors import ProviderError, VerbsError
from rdmaio.verbs import CMId, CompletionChannel, CompletionQueue, EventChannel, ProtectionDomain
from rdmaio.core.domain import Domain
from rdmaio.verbs import siw_key_guard

addr, guard, fillers = sys.argv[1], sys.argv[2] == "guard", int(sys.argv[3])
channel = EventChannel()
cm_id = CMId(channel)
cm_id.bind_addr(addr, 0)
ctx = cm_id.device()
first_cq = 0
if guard:  # what a loop's first connection does: its Domain, then a reservation on the Domain's first CQ
    domain = Domain(ctx, watch=lambda fd, callback: None)
    domain.completions.reserve(1)
    first_cq = domain.completions.cqs[0].cqe
pd = ProtectionDomain(ctx)
cq = CompletionQueue(ctx, CompletionChannel(ctx), 16)
made, silent = [], None
for i in range(fillers):
    ffi.errno = 0
    filler = lib.ibv_create_cq(ctx._ptr, 64, ffi.NULL, ffi.NULL, 0)  # 64 x 32 B + control: one page
    if filler == ffi.NULL:
        silent = {"index": i, "errno": ffi.errno}
        break
    made.append(filler)
guarded = first_cq >= siw_key_guard.GUARD_CQE
result = {"guarded": guarded, "fillers": len(made), "filler_failure": silent}
try:
    cm_id.create_qp(pd, cq, cq, max_send_wr=16, max_recv_wr=16)
    result["qp"] = "created"
except ProviderError as exc:
    result["qp"] = {"type": "ProviderError", "errno": exc.errno, "message": str(exc)}
except VerbsError as exc:
    result["qp"] = {"type": type(exc).__name__, "errno": exc.errno, "message": str(exc)}
print(json.dumps(result))
"""


def _run(rdma_addr: str, mode: str) -> dict[str, object]:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, rdma_addr, mode, str(FILLERS)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=True,
    ).stdout
    result: dict[str, object] = json.loads(out.strip().splitlines()[-1])
    return result


def test_queue_on_the_refused_key_fails_with_a_provider_error_naming_it(rdma_addr: str) -> None:
    result = _run(rdma_addr, "bare")
    assert result["guarded"] is False
    # siw's own defect, seen without rdmaio's QP code: a one-page CQ fails without an errno
    assert result["filler_failure"] == {"index": result["fillers"], "errno": 0}, result
    qp = result["qp"]
    assert isinstance(qp, dict) and qp["type"] == "ProviderError", qp
    assert qp["errno"] is None
    assert "0x90000" in str(qp["message"]) and "SIW_INVAL_UOBJ_KEY" in str(qp["message"])


def test_the_guard_keeps_every_queue_off_the_refused_key(rdma_addr: str) -> None:
    result = _run(rdma_addr, "guard")
    assert result["guarded"] is True
    assert result == {"guarded": True, "fillers": FILLERS, "filler_failure": None, "qp": "created"}
