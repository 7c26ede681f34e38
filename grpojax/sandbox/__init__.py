"""The code sandbox: runs an untrusted Python program against its tests, isolated.

`run_tests` (runner.py) drives `_sandbox.py`, a standard-library-only
supervisor that this package's directory holds with its two halves,
`_sandbox_jail.py` and `_sandbox_wire.py`; they are found by path at run
time, never imported by the trainer.
"""

from __future__ import annotations

from grpojax.sandbox.runner import (STATUSES, ExecResult, SandboxUnavailable, run_tests,
                                    sandbox_isolation)

__all__ = ["STATUSES", "ExecResult", "SandboxUnavailable", "run_tests", "sandbox_isolation"]
