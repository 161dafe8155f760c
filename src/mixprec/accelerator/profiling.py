"""``accelerator.profile()``: accelerate's profiling context, over torch.profiler.

A script that swapped only its Accelerator passes accelerate's ``ProfileKwargs`` in ``kwargs_handlers``;
that object builds its own ``torch.profiler.profile`` (``ProfileKwargs.build()``), so mixprec keeps the handler
and lets it build, rather than re-reading each of its fields. Without a handler, torch's defaults profile the
CPU (and CUDA where present). With ``output_trace_dir`` set, each process writes a Chrome trace named as
accelerate names it (``trace_<process index>.json``), then the processes meet.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch


@contextlib.contextmanager
def profile(
    handler: Any, *, process_index: int, wait_for_everyone: Callable[[], None]
) -> Iterator[torch.profiler.profile]:
    """Profile the block; ``handler``: accelerate's ``ProfileKwargs`` (or anything with ``build()`` and
    ``output_trace_dir``), or None for torch.profiler's defaults. Costs what torch.profiler costs (host syncs
    on CUDA when the trace is collected)."""
    profiler = handler.build() if handler is not None else torch.profiler.profile()
    with profiler:
        yield profiler
    trace_dir = getattr(handler, "output_trace_dir", None)
    if trace_dir is None:
        return
    os.makedirs(trace_dir, exist_ok=True)
    profiler.export_chrome_trace(os.path.join(trace_dir, f"trace_{process_index}.json"))
    wait_for_everyone()
