"""The Accelerator (mid-level API) and the pieces it delegates to.

``from mixprec import Accelerator`` is the public entry point; the submodules are implementation:
``accelerator`` (the facade) with ``processes`` (its process-side methods: topology, collectives, which
process runs what) and ``outputs`` (what it writes and reads: save_state/load_state, save_model, trackers),
``config`` (settings), ``prepared`` (the prepared model's forward, the prepared optimizer and scheduler),
``gradients`` (the accumulation schedule, its plugin and clipping), ``step_in_backward``, ``project``
(accelerate's ProjectConfiguration: settings the checkpoint manager reads; checkpoints themselves, their
format, numbering and pruning, are :mod:`mixprec.checkpoint`'s), ``saving`` (save_model's HF layout),
``lifecycle`` (what prepare accepts or refuses, free_memory), ``accelerate_compat`` (accelerate's own objects,
and ``profile()``). Distribution lives in :mod:`mixprec.strategies`, DataLoaders in
:mod:`mixprec.loaders`, experiment trackers in :mod:`mixprec.tracking`.
"""

from mixprec.accelerator.accelerator import Accelerator
from mixprec.accelerator.config import AcceleratorConfig
from mixprec.accelerator.gradients import GradientAccumulationPlugin
from mixprec.accelerator.project import ProjectConfiguration
from mixprec.loaders.data import send_to_device

__all__ = ["Accelerator", "AcceleratorConfig", "GradientAccumulationPlugin", "ProjectConfiguration", "send_to_device"]
