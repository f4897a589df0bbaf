"""torch.compile's compilations as they happen: dynamo's callback handler (`torch._dynamo.callback`).

torch calls the handler's start callbacks when a compilation begins (dynamo tracing a new frame or a new shape of
one, AOT autograd compiling a backward lazily at its first run, inductor recording CUDA graphs) and its end
callbacks when it ends, nested compilations counted as one; torch has no public hook for it (`torch.compiler` has
none in 2.11-2.14). The runner logs each one (runner/train/engine.py `log_compilations`): with
`training.compile` the first steps, an evaluation or a new micro-batch after an OOM would otherwise spend seconds to
minutes compiling with nothing in the log. Without it: no such lines; the run is unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

Event = Callable[[str, str], None]  # (what is compiled, torch's compile id "frame/recompile")

_WHAT = {"DYNAMO": "a graph", "LAZY_BACKWARD": "its backward", "CUDAGRAPH_RECORDING": "CUDA graphs (recording)",
         "TRITON_AUTOTUNING": "kernel autotuning"}  # fmt: skip


def compile_handler() -> Any | None:
    """dynamo's process-wide callback handler, or None where this torch has none with the four methods used."""
    try:
        from torch._dynamo.callback import callback_handler
    except ImportError:
        return None
    needed = ("register_start_callback", "register_end_callback", "remove_start_callback", "remove_end_callback")
    return callback_handler if all(hasattr(callback_handler, n) for n in needed) else None


def on_compilations(start: Event, end: Event) -> Callable[[], None] | None:
    """Call `start(what, id)` when a compilation begins and `end(what, id)` when it ends; returns the function that
    removes both, or None where this torch lacks the handler (nothing registered)."""
    handler = compile_handler()
    if handler is None:
        return None

    def describe(args: Any) -> tuple[str, str]:
        trigger = getattr(getattr(args, "callback_trigger", None), "name", "")
        return _WHAT.get(trigger, trigger.lower() or "a graph"), str(getattr(args, "compile_id", "?"))

    def on_start(args: Any) -> None:
        start(*describe(args))

    def on_end(args: Any) -> None:
        end(*describe(args))

    handler.register_start_callback(on_start)
    handler.register_end_callback(on_end)

    def remove() -> None:  # torch.compiler.reset() clears the handler: then there is nothing to remove
        with contextlib.suppress(ValueError):
            handler.remove_start_callback(on_start)
        with contextlib.suppress(ValueError):
            handler.remove_end_callback(on_end)

    return remove
