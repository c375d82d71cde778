"""When Python's cyclic garbage collector may run.

Each full collection stops the step loop for as long as it takes to walk every tracked
object. Objects that live as long as the process are kept out of it (`gc.freeze`): the
imported libraries' before the first engine, and in a process that keeps one engine for
its life, everything alive once that engine is built.
"""

from __future__ import annotations

import gc


def freeze_startup_objects() -> None:
    """Before the first engine of the process, keep the objects that exist (hundreds of
    thousands from the imported libraries alone) out of Python's cyclic collector: each
    full collection stops the step loop for as long as it takes to walk every tracked
    object, and these never die. Once per process, after a collection (so no garbage is
    kept); an engine itself is frozen only where `freeze_engine_objects` says so."""
    if gc.get_freeze_count() == 0:
        gc.collect()
        gc.freeze()


_engine_frozen = False


def freeze_engine_objects() -> None:
    """For a process that keeps one engine for its life (the server, the benchmarks, a
    tensor-parallel worker): once the engine is built, keep everything alive out of the
    cyclic collector too. The build makes its own many objects (the model's modules and
    parameters, compiled kernels, captured graphs, modules imported on first use), which
    every full collection would otherwise walk while the step loop waits. An engine dies
    by reference counting when dropped, frozen or not (a test checks); `shutdown()` thaws
    what was frozen, so a process that builds another engine collects as usual."""
    global _engine_frozen
    gc.collect()
    gc.freeze()
    _engine_frozen = True


def thaw_engine_objects() -> None:
    """Undo `freeze_engine_objects` (everything frozen goes back to the collector; the
    next engine freezes the startup objects again)."""
    global _engine_frozen
    if _engine_frozen:
        gc.unfreeze()
        _engine_frozen = False
