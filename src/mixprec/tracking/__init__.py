"""Experiment trackers (accelerate's ``log_with``): TensorBoard, MLflow and W&B behind one small interface,
used by the Accelerator's ``init_trackers`` / ``log`` and the Trainer's ``report_to``. A leaf: it imports
nothing else of mixprec."""
