"""mixprec.data: the embedded default corpus (no download), user text loaders, byte tokenizer, datasets."""

from mixprec.data.corpus import (
    DEFAULT_CORPUS_BYTES,
    UNIFORM_LOSS,
    VOCAB_SIZE,
    Corpus,
    decode,
    encode,
    load_corpus,
    load_text_corpus,
    split_train_val,
    stdlib_corpus,
    to_tensor,
    unigram_entropy,
)
from mixprec.data.datasets import CausalLMDataset

__all__ = [
    "DEFAULT_CORPUS_BYTES",
    "UNIFORM_LOSS",
    "VOCAB_SIZE",
    "CausalLMDataset",
    "Corpus",
    "decode",
    "encode",
    "load_corpus",
    "load_text_corpus",
    "split_train_val",
    "stdlib_corpus",
    "to_tensor",
    "unigram_entropy",
]
