"""DataLoaders, all of them: prepared ones (each process's share of the data, moved to its device, with a
resumable position) and the Trainer's, built from its datasets.

``data`` (``PreparedDataLoader``, ``send_to_device``, ``skip_first_batches``), ``sharding`` (map-style data
split by index), ``dispatch`` (batches read by the main process and sent), ``data_config``
(accelerate's ``DataLoaderConfiguration``), ``from_datasets`` (the Trainer's datasets to DataLoaders:
collation, columns, streams, the resume position), ``trainer_loaders`` (the Trainer's training and evaluation
loaders). Named apart from :mod:`mixprec.data` (a dataset: the embedded corpus).
"""
