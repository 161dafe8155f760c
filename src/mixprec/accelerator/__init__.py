"""The Accelerator (mid-level API) and the pieces it delegates to.

``from mixprec import Accelerator`` is the public entry point; the submodules are implementation:
``config`` (settings), ``distributed`` / ``ddp`` / ``fsdp`` (distributed strategies), ``prepared`` (the
prepared model, optimizer and scheduler), ``data`` / ``sharding`` (DataLoaders), ``gradients`` (the
accumulation schedule and clipping), ``state`` (save_state / load_state).
"""

from mixprec.accelerator.accelerator import Accelerator
from mixprec.accelerator.config import AcceleratorConfig
from mixprec.accelerator.data import send_to_device

__all__ = ["Accelerator", "AcceleratorConfig", "send_to_device"]
