"""A wall-clock limit on pure-Python work running in the current thread.

A chat template is Python code once Jinja compiles it; a request that brings its own can
loop for as long as it likes. Threads cannot be killed, so the limit is a trace function
on the thread doing the work: on every line it runs, past the deadline, it raises.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any


class DeadlineExceeded(BaseException):
    """Raised into code that ran past its deadline.

    A BaseException, so the `except Exception` of the code it interrupts cannot swallow it
    (the trace function that raises it is removed as it fires).
    """


def call_with_deadline(seconds: float, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` in this thread; DeadlineExceeded once it has run `seconds`.

    Only Python code is interrupted: a single long call into C (one huge string
    operation) runs to its end before the next line is traced.
    """
    deadline = time.monotonic() + seconds

    def trace(frame: Any, event: str, arg: Any) -> Any:
        if time.monotonic() > deadline:
            raise DeadlineExceeded(f"ran longer than {seconds:g} s")
        return trace

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        return fn(*args, **kwargs)
    finally:
        sys.settrace(previous)
