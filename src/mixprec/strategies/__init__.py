"""Distributed strategies: one process, DDP, FSDP2 (after Lightning Fabric's ``strategies/``).

``strategy`` (the base: one process, and every strategy's interface), ``process_group`` (the collectives
every multi-process kind shares), ``ddp``, ``fsdp`` (+ ``dcp_state``, its sharded checkpoint state),
``registry`` (a kind's name to its class: ``make_strategy``), ``launch_env`` (what the launcher told this
process), ``process_state`` (``PartialState``: the process's place in the run), ``distributed_type``
(``accelerator.distributed_type`` in accelerate's vocabulary), ``peers`` (a lost or silent
rank named), ``restarts`` (whether torchelastic restarted the group), ``verdict`` (the main process's
verdict told to every rank before any process group exists), ``comm`` (the dtype gradients travel in).

Strategies import nothing from the Accelerator's files: the Accelerator wraps a model with
``strategy.wrap_model`` and then patches its forward itself.
"""
