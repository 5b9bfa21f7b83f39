"""The checks of the tests' worker scripts (group_worker.py, pipe_worker.py,
tp_worker.py): an "ok: " line per check passed, which the test reads from the
worker's log, or "FAIL rank r: " and exit 1."""

import sys

import ps


def check(cond, msg):
    if not cond:
        print(f"FAIL rank {ps.rank()}: {msg}", flush=True)
        sys.exit(1)
    print(f"ok: {msg}", flush=True)


def raises(kind, fn, *words):
    """fn() raises kind whose message holds every word; returns the message."""
    try:
        fn()
    except kind as e:
        msg = str(e)
        missing = [w for w in words if w not in msg]
        check(not missing, f"{kind.__name__} naming {words} (missing {missing}): {msg}")
        return msg
    except Exception as e:  # noqa: BLE001 (report what came instead)
        check(False, f"expected {kind.__name__}, got {type(e).__name__}: {e}")
    check(False, f"expected {kind.__name__} naming {words}, nothing raised")
