"""Run under torchrun by test_accelerate_state.py: accelerate's helpers after only mixprec's Accelerator."""

import json
import logging
import sys
from pathlib import Path

import torch
from accelerate import PartialState
from accelerate.logging import get_logger
from accelerate.utils import gather, wait_for_everyone

from mixprec import Accelerator

logging.basicConfig(level=logging.INFO, format="%(message)s")
accelerator = Accelerator(verbose=False)
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
}
Path(sys.argv[1], f"rank{state.process_index}.json").write_text(json.dumps(out))
accelerator.end_training()
