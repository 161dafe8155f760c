"""Text to train on: the embedded default corpus (no download), user files, a byte tokenizer, the split.

The default corpus is the Python standard library's own ``.py`` source, which every Python install carries:
real, structured text (indentation, identifiers, docstrings) that a small byte-level model learns visibly
in minutes. It is deterministic for a given Python install (sorted paths, fixed cap) but differs between
Python versions, because the standard library does.

Tokenization is byte-level (vocab 256): no tokenizer file, any input encodes, and the loss is in nats per
byte, comparable with :func:`unigram_entropy`.
"""

from __future__ import annotations

import json
import math
import os
import sys
import sysconfig
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

VOCAB_SIZE = 256
"""Byte-level vocabulary: one id per byte value."""

UNIFORM_LOSS = math.log(VOCAB_SIZE)
"""ln 256 = 5.545 nats: the loss of a model that knows nothing (what a freshly initialised GPT scores)."""

DEFAULT_CORPUS_BYTES = 3 * 2**20
"""Cap of the default corpus (3 MiB). The default run (a few hundred steps of 16 x 256 bytes, about 1-2M
bytes) then sees each training byte at most once, so the validation loss measures generalisation, not
memorisation; reading it takes well under a second; and in sorted order it spans about a quarter of the
standard library (``__future__`` to ``enum``: asyncio, collections, ctypes, dataclasses, email ...)."""

DOC_SEPARATOR = b"\n\n"
"""Joins the documents of a folder or JSONL file, so one document's end is not glued to the next's start."""

# Directories that are not the standard library proper: its test suites (large, repetitive fixtures) and
# third-party installs. "encodings" is skipped too: ~1.4 MB of generated codec tables (hex literals) that
# would teach the model lookup tables, not code.
_SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "encodings"})
# _sysconfigdata_*.py holds the build machine's compiler flags and paths, not library code
_SKIP_FILE_PREFIXES = ("_sysconfigdata",)
# A file whose first block holds a NUL byte is binary (git's heuristic); a folder of "text" rarely is pure.
_BINARY_SNIFF_BYTES = 8192


@dataclass(frozen=True)
class Corpus:
    """A corpus as bytes, with where it came from (for logs)."""

    data: bytes
    """The whole corpus; token ids are these byte values."""
    source: str
    """One line for logs, e.g. "Python 3.11 standard library source (187 files, 3.0 MiB)"."""
    num_documents: int
    """Files (or JSONL records) the corpus was assembled from."""

    def __len__(self) -> int:
        return len(self.data)

    def split(self, val_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
        """``split_train_val(self.data, val_fraction)``: (train, validation) uint8 tensors."""
        return split_train_val(self.data, val_fraction)


def encode(text: str | bytes) -> list[int]:
    """Token ids of ``text``: its UTF-8 bytes (bytes pass through). ``torch.tensor(encode(s))`` for a model."""
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return list(data)


def decode(ids: Iterable[int] | torch.Tensor) -> str:
    """Text of byte ids; invalid UTF-8 (a sample cut mid-character) becomes U+FFFD instead of raising.

    A tensor argument is copied to the host (a sync if it lives on an accelerator).
    """
    if isinstance(ids, torch.Tensor):
        ids = ids.detach().flatten().cpu().tolist()
    ids = list(ids)
    bad = [i for i in ids if not 0 <= int(i) < VOCAB_SIZE]
    if bad:
        raise ValueError(f"decode: byte ids must be in [0, 255], got {bad[:5]}")
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def to_tensor(data: bytes) -> torch.Tensor:
    """The bytes as a 1-D uint8 tensor (one byte per token: 1 MB of text is 1 MB of tokens)."""
    # bytearray: frombuffer needs a writable buffer to share, and the copy keeps the tensor independent
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def _stdlib_files(root: Path) -> list[str]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        # prune in place so os.walk never descends into site-packages (thousands of files)
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(".")]
        for name in filenames:
            if name.endswith(".py") and not name.startswith(_SKIP_FILE_PREFIXES):
                found.append(Path(dirpath, name).relative_to(root).as_posix())
    return sorted(found)


@lru_cache(maxsize=4)
def _stdlib_corpus_cached(root: str, max_bytes: int) -> Corpus:
    files = _stdlib_files(Path(root))
    parts: list[bytes] = []
    size = 0
    for rel in files:
        if size >= max_bytes:
            break
        # a header comment per file keeps the corpus valid Python and marks document boundaries
        chunk = f"# ---- {rel} ----\n".encode() + Path(root, rel).read_bytes() + b"\n"
        parts.append(chunk[: max_bytes - size])
        size += len(parts[-1])
    data = b"".join(parts)
    if not data:
        raise RuntimeError(
            f"no Python source files found under the standard library folder {root} (some minimal "
            f"installs ship only .pyc files); pass your own text with --data PATH"
        )
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    source = f"Python {version} standard library source ({len(parts)} files, {len(data) / 2**20:.1f} MiB)"
    return Corpus(data=data, source=source, num_documents=len(parts))


def stdlib_corpus(max_bytes: int = DEFAULT_CORPUS_BYTES) -> Corpus:
    """The default corpus: this Python's standard library ``.py`` files, sorted by path, capped to ``max_bytes``.

    Test suites, site-packages, generated codec tables and build-specific files are skipped; each file is
    preceded by a ``# ---- path ----`` line; the last file is cut to make exactly ``max_bytes`` (or all of
    the source, if less). Cached per ``max_bytes``: repeated calls do not reread the disk.
    """
    if not isinstance(max_bytes, int) or max_bytes <= 0:
        raise ValueError(f"max_bytes must be a positive integer, got {max_bytes!r}")
    return _stdlib_corpus_cached(str(Path(sysconfig.get_paths()["stdlib"])), max_bytes)


def _is_binary(path: Path) -> bool:
    with path.open("rb") as f:
        return b"\0" in f.read(_BINARY_SNIFF_BYTES)


def _read_jsonl(path: Path, text_field: str) -> list[bytes]:
    docs = []
    with path.open("rb") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are both ValueErrors
                raise ValueError(f"--data {path}: line {lineno} is not valid JSON ({e})") from None
            if not isinstance(record, dict) or text_field not in record:
                have = ", ".join(sorted(record)) if isinstance(record, dict) else type(record).__name__
                raise ValueError(
                    f"--data {path}: line {lineno} has no {text_field!r} field (found: {have}); "
                    f"choose the field with --text-field"
                )
            text = record[text_field]
            if not isinstance(text, str):
                raise ValueError(
                    f"--data {path}: line {lineno}: field {text_field!r} must be a string, got {type(text).__name__}"
                )
            docs.append(text.encode("utf-8"))
    return docs


def _read_documents(path: Path, text_field: str) -> list[bytes]:
    if path.suffix.lower() == ".jsonl":
        return _read_jsonl(path, text_field)
    return [path.read_bytes()]


def _folder_files(folder: Path) -> list[Path]:
    found = []
    for dirpath, dirnames, filenames in os.walk(folder):
        # hidden folders (.git, .venv) hold tooling, not the user's text
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        found.extend(Path(dirpath, n) for n in filenames if not n.startswith("."))
    return sorted(found, key=lambda p: p.relative_to(folder).as_posix())


def load_text_corpus(path: str | os.PathLike[str], *, text_field: str = "text", max_bytes: int | None = None) -> Corpus:
    """A user corpus: a text file, a ``.jsonl`` file (one JSON object per line, text in ``text_field``), or a
    folder of them (recursive, sorted by path; hidden entries and binary files skipped).

    Files are read as bytes (no decoding needed for a byte-level model); documents are joined by a blank
    line. ``max_bytes`` truncates the result. Errors name the path (and the line of a bad JSONL record).
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"--data: no such file or folder: {p}")
    if p.is_dir():
        files = [f for f in _folder_files(p) if f.suffix.lower() == ".jsonl" or not _is_binary(f)]
        docs = [doc for f in files for doc in _read_documents(f, text_field)]
    else:
        docs = _read_documents(p, text_field)
    docs = [d for d in docs if d]
    data = DOC_SEPARATOR.join(docs)
    if max_bytes is not None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be a positive integer or None, got {max_bytes!r}")
        data = data[:max_bytes]
    if not data:
        what = "folder holds no non-empty text files" if p.is_dir() else "file holds no text"
        raise ValueError(f"--data {p}: the corpus is empty (the {what})")
    kind = "folder" if p.is_dir() else "file"
    source = f"{p} ({kind}, {len(docs)} documents, {len(data) / 2**20:.1f} MiB)"
    return Corpus(data=data, source=source, num_documents=len(docs))


def load_corpus(
    path: str | os.PathLike[str] | None = None, *, text_field: str = "text", max_bytes: int | None = None
) -> Corpus:
    """What ``--data`` means: ``path`` loaded by :func:`load_text_corpus`, or the default corpus if None."""
    if path is None:
        return stdlib_corpus(DEFAULT_CORPUS_BYTES if max_bytes is None else max_bytes)
    return load_text_corpus(path, text_field=text_field, max_bytes=max_bytes)


def split_train_val(data: bytes | torch.Tensor, val_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation) uint8 tensors: the last ``val_fraction`` of the bytes is validation.

    A contiguous tail rather than a random sample: with the default corpus that is whole files the model
    never trained on, so the validation loss is not inflated by near-duplicate neighbours. Deterministic.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction!r}")
    tokens = data if isinstance(data, torch.Tensor) else to_tensor(data)
    if tokens.dim() != 1:
        raise ValueError(f"data must be 1-D, got shape {tuple(tokens.shape)}")
    n_val = int(round(len(tokens) * val_fraction))
    if val_fraction > 0 and n_val == 0 and len(tokens) > 1:
        n_val = 1  # a requested validation set is never silently empty
    n_train = len(tokens) - n_val
    return tokens[:n_train], tokens[n_train:]


def unigram_entropy(tokens: bytes | torch.Tensor) -> float:
    """Entropy in nats of the byte distribution: the loss of the best model that ignores context.

    A model "has learned" when its loss is well below this; uniform guessing scores ln 256 = 5.55.
    A tensor argument is reduced to a Python float (a sync if it lives on an accelerator).
    """
    t = tokens if isinstance(tokens, torch.Tensor) else to_tensor(tokens)
    if t.numel() == 0:
        raise ValueError("unigram_entropy of an empty corpus is undefined")
    counts = torch.bincount(t.flatten().long(), minlength=VOCAB_SIZE).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())
