"""The shape of the built-in :class:`~mixprec.models.gpt.GPT`: :class:`GPTConfig` (each field checked in
``__post_init__``) and the named shapes ``GPT_PRESETS`` that ``mixprec train|bench --model`` choose from."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class GPTConfig:
    """Shape of a :class:`GPT`. Every field is validated in ``__post_init__``."""

    vocab_size: int = 256
    """Number of token ids. 256 is the byte-level tokenizer of ``mixprec.data``."""
    block_size: int = 256
    """Longest sequence the model accepts (size of the learned position table)."""
    n_layer: int = 4
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide ``n_embd``."""
    n_embd: int = 128
    """Width of the residual stream."""
    dropout: float = 0.0
    """Dropout on embeddings, attention weights and residual branches, in [0, 1)."""
    bias: bool = True
    """Biases in Linear layers and LayerNorms (False is slightly faster, as in nanoGPT)."""
    vocab_multiple: int = 1
    """Rows of the embedding and the head rounded up to a multiple of this (64: nanoGPT's 50257 -> 50304), so the
    head's matmuls run on aligned shapes. The extra rows are cut from the logits before the softmax: the same
    model as without them, faster (issue 28)."""
    loss_chunk_size: int | None = None
    """While training, compute the loss this many tokens at a time without ever holding (tokens x vocab)
    logits (models/chunked_loss.py); the output's logits are then None. None: the plain path."""
    z_loss: float = 0.0
    """Weight of the z-loss, ``z_loss * mean(logsumexp(logits)^2)`` added to the training loss (PaLM; 1e-4 in
    Wortsman et al. 2023, arXiv 2309.14322): keeps the output log-partition near 0, against output-logit
    divergence at high learning rates. 0 (the default) adds nothing."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            # bool is an int subclass; True as a layer count is always a mistake
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"GPTConfig.n_embd={self.n_embd} must be divisible by n_head={self.n_head} "
                f"(each head gets n_embd / n_head dimensions)"
            )
        for name in ("vocab_multiple", "loss_chunk_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if self.vocab_multiple is None:
            raise ValueError("GPTConfig.vocab_multiple must be a positive integer (1: no padding), got None")
        if not 0.0 <= float(self.dropout) < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")
        if not 0.0 <= float(self.z_loss) < 1.0:
            raise ValueError(f"GPTConfig.z_loss must be in [0, 1) (1e-4 is the usual weight), got {self.z_loss!r}")
        if self.z_loss and self.loss_chunk_size:
            # the chunked loss never holds the logits the z-loss squares: refuse rather than drop the term
            raise ValueError(
                f"GPTConfig(z_loss={self.z_loss!r}, loss_chunk_size={self.loss_chunk_size!r}): the chunked loss "
                "does not compute the z-loss; set loss_chunk_size=None to use z_loss, or z_loss=0"
            )

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding and the head: ``vocab_size`` rounded up to ``vocab_multiple``."""
        return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple


GPT_PRESETS: dict[str, GPTConfig] = {
    # for tests: a forward + backward takes milliseconds
    "tiny": GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=64),
    # the default of `mixprec train`: a few hundred steps at batch 16 x 256 bytes take 2-3 minutes on
    # 2 CPU cores and bring the loss well below the unigram baseline (measured, see docs)
    "small": GPTConfig(block_size=256, n_layer=4, n_head=4, n_embd=128),
    # GPT-2 124M shape, for GPU benchmarks only (its vocabulary does not match the byte corpus)
    "gpt2": GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768),
    # near 1B (0.91B parameters) for GPU benchmarks: GPT-2's vocabulary and context, 16 layers x 2048 (issue 28)
    "gpt-1b": GPTConfig(vocab_size=50257, block_size=1024, n_layer=16, n_head=16, n_embd=2048),
}
