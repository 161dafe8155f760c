"""The Accelerator (mid-level API) and the pieces it delegates to.

``from mixprec import Accelerator`` is the public entry point; the submodules are implementation:
``accelerator`` (the facade: one line a member, naming the part that does it, ``delegation``) over the parts it
owns: ``preparation`` (prepare, its registry, unwrap_model, free_memory), ``processes`` (collectives), the
process state (:mod:`mixprec.strategies.process_state`: topology, which process runs what), ``run_files``
(save_state/load_state through the checkpoint manager, save_model, the elastic resume),
:class:`~mixprec.tracking.trackers.Trackers` (log_with) and ``gradients`` (the accumulation schedule, its plugin
and clipping). Beside them: ``config`` (settings), ``prepared`` (the prepared model's forward, the prepared
optimizer and scheduler), ``step_in_backward``, ``project`` (accelerate's ProjectConfiguration: settings the
checkpoint manager reads; checkpoints themselves, their format, numbering and pruning, are
:mod:`mixprec.checkpoint`'s), ``hf_weights`` (save_model's HF layout), ``accelerate_compat`` (accelerate's own
objects, and ``profile()``). Distribution lives in :mod:`mixprec.strategies`, DataLoaders in
:mod:`mixprec.loaders`, experiment trackers in :mod:`mixprec.tracking`.
"""

from mixprec.accelerator.accelerator import Accelerator
from mixprec.accelerator.config import AcceleratorConfig
from mixprec.accelerator.gradients import GradientAccumulationPlugin
from mixprec.accelerator.project import ProjectConfiguration
from mixprec.loaders.data import send_to_device

__all__ = ["Accelerator", "AcceleratorConfig", "GradientAccumulationPlugin", "ProjectConfiguration", "send_to_device"]
