"""mixprec.bench: the same workload under fp32, fp16, bf16 and "auto", side by side, honestly measured.

``run_bench(workload, BenchConfig(...)) -> BenchResult``; ``format_table``, ``write_chart`` and ``to_json``
render it. ``mixprec bench`` is the command line over these.
"""

from mixprec.bench.bench_config import DEFAULT_PRECISIONS, BenchConfig
from mixprec.bench.memory import MemoryMeasurement, cpu_memory_supported, measure_run
from mixprec.bench.peak import PeakFlops, measure_peak_flops
from mixprec.bench.render import format_table, to_json, write_chart
from mixprec.bench.result import AUTO_TOLERANCE, BenchResult, PrecisionResult
from mixprec.bench.runner import loss_of, memory_run, run_bench, train_step
from mixprec.bench.timing import CpuTimer, CudaTimer, Summary, make_timer, summarize
from mixprec.bench.workload import Workload, estimate_flops_per_token, sample_batches, workload_from_dataset

__all__ = [
    "AUTO_TOLERANCE",
    "DEFAULT_PRECISIONS",
    "BenchConfig",
    "BenchResult",
    "CpuTimer",
    "CudaTimer",
    "MemoryMeasurement",
    "PeakFlops",
    "PrecisionResult",
    "Summary",
    "Workload",
    "cpu_memory_supported",
    "estimate_flops_per_token",
    "format_table",
    "loss_of",
    "make_timer",
    "measure_peak_flops",
    "measure_run",
    "memory_run",
    "run_bench",
    "sample_batches",
    "summarize",
    "to_json",
    "train_step",
    "workload_from_dataset",
    "write_chart",
]
