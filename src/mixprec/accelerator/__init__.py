"""The Accelerator (mid-level API) and the pieces it delegates to.

``from mixprec import Accelerator`` is the public entry point; the submodules are implementation:
``config`` (settings), ``distributed`` / ``ddp`` / ``fsdp`` (distributed strategies), ``prepared`` (the
prepared model, optimizer and scheduler), ``data`` / ``sharding`` / ``data_config`` (DataLoaders), ``gradients`` (the
accumulation schedule, its plugin and clipping), ``state`` (the save_state / load_state format),
``checkpoints`` and ``project`` (automatic checkpoint naming, state hooks), ``saving`` (save_model's HF
layout), ``process_state`` (``PartialState``, ``accelerator.state``), ``lifecycle`` (what prepare accepts, free_memory),
``model_checks`` (what prepare refuses).
"""

from mixprec.accelerator.accelerator import Accelerator
from mixprec.accelerator.config import AcceleratorConfig
from mixprec.accelerator.data import send_to_device
from mixprec.accelerator.gradients import GradientAccumulationPlugin
from mixprec.accelerator.project import ProjectConfiguration

__all__ = ["Accelerator", "AcceleratorConfig", "GradientAccumulationPlugin", "ProjectConfiguration", "send_to_device"]
