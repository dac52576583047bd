"""A test hook that makes a model step fail the way real faults do, inside the engine-core process.

PAGEDSERVE_FAULT_INJECTION=ACTION:TOKEN_ID[,ACTION:TOKEN_ID...] makes the step whose batch holds a
sequence with TOKEN_ID as its first prompt token
  raise  raise RuntimeError inside the step (a kernel or device error),
  hang   block forever inside the step (a wedged device or a deadlock),
  exit   end the process at once (a crash: segfault, OOM kill).
Unset (always, outside tests) it costs nothing: no wrapper is installed.
"""
from __future__ import annotations

import os
import time

ENV = "PAGEDSERVE_FAULT_INJECTION"


class InjectedFault(RuntimeError):
    pass


def from_env() -> dict[int, str] | None:
    """{token_id: action} from the environment, or None."""
    value = os.environ.get(ENV, "").strip()
    if not value:
        return None
    faults = {}
    for item in value.split(","):
        action, _, token = item.strip().partition(":")
        if action not in ("raise", "hang", "exit") or not token.strip().isdigit():
            raise ValueError(f"{ENV} must be ACTION:TOKEN_ID[,...] with ACTION raise|hang|exit, got {value!r}")
        faults[int(token)] = action
    return faults


def check(sched, faults: dict[int, str]) -> None:
    """Called at the start of a model step with the scheduled batch."""
    for e in sched.scheduled:
        action = faults.get(e.seq.token_ids[0]) if e.seq.token_ids else None
        if action == "raise":
            raise InjectedFault(f"injected fault in a model step (token {e.seq.token_ids[0]})")
        if action == "hang":
            while True:
                time.sleep(3600)
        if action == "exit":
            os._exit(3)
