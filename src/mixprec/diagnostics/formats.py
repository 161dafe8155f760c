"""The ranges the diagnosis measures gradients and activations against: owned by ``mixprec.precision.formats``
(a precision answers its own ``compute_format``), re-exported here for the diagnosis and older imports."""

from mixprec.precision.formats import BF16, FORMATS, FP16, FP32, FloatFormat, format_of, loss_scale_for

__all__ = ["BF16", "FORMATS", "FP16", "FP32", "FloatFormat", "format_of", "loss_scale_for"]
