"""Run under torchrun by test_accelerate_state.py: accelerate's helpers after only mixprec's Accelerator."""

import json
import logging
import sys
import time
from pathlib import Path

import torch
from accelerate import DistributedDataParallelKwargs, PartialState
from accelerate.logging import get_logger
from accelerate.utils import gather, wait_for_everyone

from mixprec import Accelerator, TrainingArguments

logging.basicConfig(level=logging.INFO, format="%(message)s")
# run_clm.py's order: TrainingArguments.main_process_first around preprocessing, before any Accelerator/Trainer.
marker = Path(sys.argv[1], "cache_written")
args = TrainingArguments(sys.argv[1], report_to="none")
with args.main_process_first(desc="dataset map tokenization"):
    if args.process_index == 0:
        time.sleep(0.5)  # a slow preprocessing step: the other process must not enter before it ends
        marker.write_text("done")
    cache_seen = marker.exists()
# accelerate's test_kwargs_handlers.py main(), run here under torchrun: DDP gets the handler's settings.
ddp_handler = DistributedDataParallelKwargs(bucket_cap_mb=15, find_unused_parameters=True)
accelerator = Accelerator(verbose=False, kwargs_handlers=[ddp_handler])
model = accelerator.prepare(torch.nn.Linear(4, 2))
ddp = model.__dict__["_mixprec"].ddp  # mixprec keeps the user's module and runs it through this DDP wrapper
logger = get_logger(__name__)
logger.info("from the main process only")  # raised "You must initialize the accelerate state" (issue 22)
logger.info("from every process", main_process_only=False)
state = PartialState()
rank = torch.tensor([float(state.process_index)])
wait_for_everyone()
gathered = gather(rank).tolist()
out = {
    "process_index": state.process_index,
    "num_processes": state.num_processes,
    "local_process_index": state.local_process_index,
    "device": str(state.device),
    "is_main_process": state.is_main_process,
    "mixprec": [accelerator.process_index, accelerator.num_processes, str(accelerator.device)],
    "gathered": gathered,
    "cache_seen": cache_seen,
    "ddp": [ddp.bucket_bytes_cap // 2**20, ddp.find_unused_parameters, ddp.broadcast_buffers],
    "parallel_mode": args.parallel_mode.value,
}
Path(sys.argv[1], f"rank{state.process_index}.json").write_text(json.dumps(out))
accelerator.end_training()
