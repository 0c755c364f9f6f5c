"""Progress on stderr while nothing else moves: a spinner for a phase (loading, compiling, a long
prefill) and `ticking` to keep a tqdm bar's clock running through one.

Both draw only on a terminal (`progress_default()`: stderr is a TTY and $CI is unset) unless told
otherwise, so logs, pipes and CI stay clean. They are built on tqdm, the package's progress library.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator

#: Seconds between redraws of a spinner or a ticking bar.
REFRESH_S = 0.1


def progress_default() -> bool:
    """Whether progress is drawn when the caller does not say: stderr is a terminal and $CI is
    unset."""
    return bool(sys.stderr.isatty()) and not os.environ.get("CI")


@contextlib.contextmanager
def ticking(bar, desc: str | None = None) -> Iterator[None]:
    """Within the block, redraw tqdm `bar` every REFRESH_S seconds (its elapsed time keeps
    counting while the block waits on the device); `desc` replaces the bar's description for the
    block. A disabled bar is left alone."""
    if getattr(bar, "disable", True):
        yield
        return
    if desc is not None:
        bar.set_description_str(desc, refresh=False)
    stop = threading.Event()

    def run():
        while not stop.wait(REFRESH_S):
            bar.refresh()

    thread = threading.Thread(target=run, name="jax-onnx-attn-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        bar.refresh()


@contextlib.contextmanager
def spinner(desc: str, enabled: bool | None = None) -> Iterator[None]:
    """A one-line spinner with the elapsed time ("desc ⠹ 2.3s") on stderr for the block; erased
    when the block ends. enabled=None: `progress_default()`."""
    if enabled is None:
        enabled = progress_default()
    if not enabled:
        yield
        return
    from tqdm import tqdm

    frames = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"
    with tqdm(total=None, desc=desc, leave=False, file=sys.stderr, bar_format="{desc} {elapsed}") as bar:
        state = {"i": 0}
        orig_refresh = bar.refresh

        def refresh(*args, **kwargs):
            state["i"] += 1
            bar.desc = f"{desc} {frames[state['i'] % len(frames)]}"
            return orig_refresh(*args, **kwargs)

        bar.refresh = refresh
        with ticking(bar):
            yield


__all__ = ["REFRESH_S", "progress_default", "spinner", "ticking"]
