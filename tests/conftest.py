"""Shared fixtures: a tiny HF-style language model, its data, and the rule that skips GPU tests without CUDA.

The model mirrors what the seed's snippets call: ``model(input_ids, labels=labels)`` returns an object with
``.loss`` and ``.logits``. It is small enough (a few thousand parameters) that an fp16 autocast step costs
about a millisecond on this CPU, where fp16 compute is emulated and ~10x slower than fp32.
"""

from __future__ import annotations

import os

# One intra-op thread for the whole suite and the processes it launches: its models are tiny, and on a
# shared 2-core machine a second OpenMP thread mostly waits for a core (tests ran ~2x slower with two).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Tests write only under temporary folders: wandb's core writes core-debug-*.log under $WANDB_CACHE_DIR (else
# ~/.cache/wandb/logs) whatever a run's dir is (issue 29), so its folders point into one for the session.
_WANDB_TMP = __import__("tempfile").mkdtemp(prefix="mixprec-tests-wandb-")
for _var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
    os.environ[_var] = _WANDB_TMP
# "auto" measures every run afresh in tests (its on-disk cache is tested on its own, in a temporary folder).
os.environ["MIXPREC_AUTO_CACHE"] = "0"
# ...and races the uniform modes only: the per-op-kind policy candidate is tested on its own (test_precision_auto)
os.environ["MIXPREC_AUTO_OP_POLICY"] = "0"
# ...and every candidate is raced, not left out by the CPU probe first: planted speeds are the tests' subject
# (the probe's filter is tested on its own, test_precision_auto)
os.environ["MIXPREC_AUTO_PREFILTER"] = "0"
# ...and an in-run race is replayed in the chosen mode however short the run (a test's runs are a few dozen steps;
# the replay's share limit is tested on its own, test_race_rewind)
os.environ["MIXPREC_AUTO_REPLAY"] = "all"

from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

VOCAB = 16
SEQ = 8


@dataclass
class TinyOutput:
    """What HF causal LMs return, reduced to the two fields the seed's loop reads."""

    loss: torch.Tensor | None
    logits: torch.Tensor


class TinyLM(torch.nn.Module):
    """Embedding -> Linear -> GELU -> Linear -> logits; cross-entropy when ``labels`` are given."""

    def __init__(self, vocab: int = VOCAB, width: int = 32) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.hidden = torch.nn.Linear(width, width)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> TinyOutput:
        logits = self.head(F.gelu(self.hidden(self.embed(input_ids))))
        loss = None
        if labels is not None:
            # cross_entropy autocasts to fp32, as HF models' losses do
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        return TinyOutput(loss=loss, logits=logits)


def make_tiny_lm(seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM()


def make_batches(n: int = 20, batch: int = 8, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """A learnable task: the label of each token is the next token id (mod VOCAB)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
        out.append({"input_ids": ids, "labels": (ids + 1) % VOCAB})
    return out


def race_in_run(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """Make auto race as the run's steps, afresh (no cache, no prefilter, no per-op policy); returns a function
    that names its candidates (precision classes, built for the run's device)."""
    for name, value in [
        ("MIXPREC_AUTO_RACE", "in-run"),
        ("MIXPREC_AUTO_CACHE", "0"),
        ("MIXPREC_AUTO_PREFILTER", "0"),
        ("MIXPREC_AUTO_OP_POLICY", "0"),
    ]:
        monkeypatch.setenv(name, value)

    def candidates(*classes: type) -> None:
        from mixprec.precision import registry

        monkeypatch.setattr(registry, "auto_candidates", lambda device: [cls(device) for cls in classes])

    return candidates


@pytest.fixture
def one_thread():
    """One torch thread for the test (``pytestmark = pytest.mark.usefixtures("one_thread")`` in a file): its
    models are tiny, and on 2 shared cores a second intra-op thread only waits for a core (several times
    slower, and less deterministic)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """A small Python source file for ``mixprec train --data``, varied enough that the validation split is not a
    copy of the training split."""
    lines = [f"def f{i}(x):\n    return x * {i} + {i % 7}  # line {i}\n" for i in range(400)]
    path = tmp_path_factory.mktemp("data") / "corpus.py"
    path.write_text("".join(lines))
    return str(path)


@pytest.fixture
def quick_train_cli(tmp_path, monkeypatch, one_thread):
    """``mixprec train`` in seconds (``pytestmark = pytest.mark.usefixtures("quick_train_cli")``): run from
    tmp_path (a default runs/ folder lands there), a 24-byte sample (generated a byte per forward pass), one
    thread."""
    from mixprec.cli import train as train_cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(train_cli, "SAMPLE_BYTES", 24)


@pytest.fixture
def tiny_lm() -> TinyLM:
    return make_tiny_lm()


@pytest.fixture
def batches() -> list[dict[str, torch.Tensor]]:
    return make_batches()


def cuda_available() -> bool:
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked ``gpu`` on a machine without CUDA (pyproject declares the marker)."""
    if cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; torch.cuda.is_available() is False")
    for item in items:
        # the marker itself: item.keywords also holds the names of parent folders (a checkout in .../gpu/)
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
