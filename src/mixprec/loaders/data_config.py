"""``DataLoaderConfiguration``: HF Accelerate's DataLoader settings, as ``Accelerator(dataloader_config=...)``.

mixprec's prepared DataLoaders split each epoch by index (:mod:`mixprec.loaders.sharding`) or by the main
process dispatching batches (:mod:`mixprec.loaders.dispatch`). The settings that ask for one of those are
accepted; those that ask for something else are refused by name, with what to do instead, rather than ignored.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DataLoaderConfiguration:
    split_batches: bool = False
    """True in accelerate: a DataLoader's batch size is the global one, split across processes. Refused: give
    the per-process batch size instead (global batch / number of processes)."""

    dispatch_batches: bool | None = None
    """True: the main process reads every batch and sends each process its own
    (:mod:`mixprec.loaders.dispatch`), for data that cannot be split by index (a stream, a custom
    sampler). None (default, as accelerate): dispatch IterableDatasets in several processes, split the others.
    False: never dispatch (an IterableDataset in several processes is then refused)."""

    even_batches: bool = True
    """Accepted either way: mixprec gives every process the same number of batches without repeating a
    sample (a tail shorter than the number of processes is folded into the step before it)."""

    use_seedable_sampler: bool = False
    """Accepted either way: the shuffle order of a prepared DataLoader always depends only on a seed drawn
    from ``torch.manual_seed`` (or the DataLoader's generator) and the epoch."""

    data_seed: int | None = None
    """Refused when set: seed the DataLoader (``generator=torch.Generator().manual_seed(seed)``) instead."""

    non_blocking: bool = False
    """Copy batches to the device asynchronously (``Accelerator(non_blocking=True)``)."""

    use_stateful_dataloader: bool = False
    """Accepted either way: ``save_state`` always records a prepared DataLoader's position and ``load_state``
    resumes from it."""

    def __post_init__(self) -> None:
        if self.split_batches:
            raise ValueError(
                "DataLoaderConfiguration(split_batches=True) is not supported: pass the per-process batch size "
                "to the DataLoader"
            )
        if self.data_seed is not None:
            raise ValueError(
                f"DataLoaderConfiguration(data_seed={self.data_seed!r}) is not supported: seed the DataLoader "
                "instead (generator=torch.Generator().manual_seed(seed))"
            )
