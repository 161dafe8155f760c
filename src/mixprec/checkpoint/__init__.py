"""Crash-safe, pickle-free checkpoint primitives: atomic folders, safe formats, RNG capture.

- :func:`atomic_dir` writes a folder that appears complete or not at all (a crash leaves the old one).
- :func:`save_tensors` / :func:`load_tensors` (safetensors), :func:`save_json` / :func:`load_json`,
  :func:`save_torch` / :func:`load_torch` (``torch.load(weights_only=True)``): nothing loaded here can run
  code; a file that would need arbitrary unpickling is refused with :class:`UnsafeCheckpointError`.
- :func:`rng_state` / :func:`set_rng_state`: python, numpy, torch and CUDA generators.
- :func:`write_manifest` / :func:`verify_manifest`: every file's size and SHA-256, written last; a folder
  is complete and intact only when its manifest verifies.
- :func:`lock_folder`: one run per folder (an OS file lock, released by the OS when the process dies).
"""

from mixprec.checkpoint.atomic import DiskFullError, abort, atomic_dir, begin, commit, recover, temp_path
from mixprec.checkpoint.lock import FolderInUseError, FolderLock, lock_folder
from mixprec.checkpoint.manifest import MANIFEST, verify_manifest, write_manifest
from mixprec.checkpoint.rng import rng_state, set_rng_state
from mixprec.checkpoint.safe_files import (
    CheckpointError,
    UnsafeCheckpointError,
    load_json,
    load_tensors,
    load_torch,
    save_json,
    save_tensors,
    save_torch,
)

__all__ = [
    "MANIFEST",
    "CheckpointError",
    "DiskFullError",
    "FolderInUseError",
    "FolderLock",
    "UnsafeCheckpointError",
    "abort",
    "atomic_dir",
    "begin",
    "commit",
    "load_json",
    "load_tensors",
    "load_torch",
    "lock_folder",
    "recover",
    "rng_state",
    "save_json",
    "save_tensors",
    "save_torch",
    "set_rng_state",
    "temp_path",
    "verify_manifest",
    "write_manifest",
]
