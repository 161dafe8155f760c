"""Prepared DataLoaders: each process's share of the data, moved to its device, with a resumable position.

``data`` (``PreparedDataLoader``, ``send_to_device``, ``skip_first_batches``), ``sharding`` (map-style data
split by index), ``dispatch`` (batches read by the main process and sent), ``data_config``
(accelerate's ``DataLoaderConfiguration``). Named apart from :mod:`mixprec.data` (the embedded corpus).
"""
