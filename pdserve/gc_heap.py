"""Python's garbage collector and a serving process's long-lived heap.

A worker or router process holds a few hundred thousand container objects once it is up (torch,
transformers, Ray, gRPC, the model's modules): a full (oldest-generation) collection walks all of
them, and holds the GIL while it does, so every thread of the process stops. In a decode worker
(SmolLM2 loaded, ~370k tracked objects, session 37, docs/benchmarks.md) one took 180-210 ms: a
stall of every sequence in the batch, seen in served runs as inter-token gaps of 100-700 ms a few
times a minute. :func:`freeze_heap` moves everything alive at the end of startup into the
collector's permanent generation (``gc.freeze``, Python 3.7+), which collections skip: the same
process then collects in under a millisecond. vLLM does the same after its engine and API server
start (its ``freeze_gc_heap``). Objects frozen are never collected (a frozen
object that later becomes cyclic garbage stays in memory), so a process freezes once: after its
startup, when what is alive is what it keeps.
"""

from __future__ import annotations

import gc
import threading

_lock = threading.Lock()
_frozen = False


def freeze_heap() -> bool:
    """Once per process: collect every generation (so startup garbage is not kept), then freeze
    what is left. Returns whether this call froze (False: an earlier call did)."""
    global _frozen
    with _lock:
        if _frozen:
            return False
        gc.collect(0)
        gc.collect(1)
        gc.collect(2)
        gc.freeze()
        _frozen = True
        return True
