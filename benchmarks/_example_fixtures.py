"""The local stand-ins the upstream examples load from the Hub, written into one folder the scripts run in.

Nothing is downloaded. The examples ask for ``bert-base-cased``, ``nyu-mll/glue``/``mrpc`` and the metrics
``glue`` and ``accuracy`` by name; transformers, datasets and evaluate all try a name as a local path first, so
folders with those names in the scripts' working directory answer instead of the Hub and the scripts run
unedited:

- ``bert-base-cased/``: a 2-layer, 64-wide BERT for sequence classification and a WordPiece tokenizer
  trained here on the generated text;
- ``tiny-gpt2/``: a 2-layer, 64-wide GPT-2 and a byte-level BPE tokenizer (passed to the transformers
  language-modeling scripts by ``--model_name_or_path``, their documented way to name a model);
- ``nyu-mll/glue/``: an MRPC-shaped dataset (sentence1, sentence2, label, idx) whose README's ``configs:``
  block names the ``mrpc`` configuration, as the Hub dataset's does;
- ``glue/glue.py`` and ``accuracy/accuracy.py``: evaluate metric modules computing accuracy (and F1 for
  glue), in place of the Hub's scripts, which need scikit-learn;
- ``text/train.txt``, ``text/validation.txt`` and ``pairs/train.csv``, ``pairs/validation.csv`` for the
  scripts that take ``--train_file``.

The text is generated from a small grammar with a fixed seed, so every run sees the same data. Paraphrase
pairs (label 1) share their words; others are two independent sentences, so the label is learnable.
"""

from __future__ import annotations

import csv
import random
from pathlib import Path

SUBJECTS = ["the cat", "a dog", "my friend", "the teacher", "our neighbour", "the old man", "a child", "the bird"]
VERBS = ["sees", "likes", "finds", "follows", "paints", "visits", "helps", "watches"]
OBJECTS = ["the river", "a red house", "the garden", "an apple", "the market", "a small boat", "the hill", "a book"]
ENDINGS = ["today", "at night", "in the morning", "again", "with care", "after lunch", "near the sea", "quietly"]

ACCURACY_METRIC = '''"""accuracy, written by mixprec's upstream examples benchmark in place of the Hub's script."""
import datasets
import evaluate
import numpy as np


class {name}(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="accuracy{extra_doc}",
            citation="",
            inputs_description="predictions, references: integer labels",
            features=datasets.Features(
                {{"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}}
            ),
        )

    def _compute(self, predictions, references):
        p, r = np.asarray(predictions), np.asarray(references)
        out = {{"accuracy": float((p == r).mean())}}
        if {with_f1}:
            tp = float(((p == 1) & (r == 1)).sum())
            out["f1"] = 2 * tp / max(float((p == 1).sum() + (r == 1).sum()), 1.0)
        return out
'''

GLUE_README = """---
configs:
- config_name: mrpc
  data_files:
  - split: train
    path: mrpc/train.csv
  - split: validation
    path: mrpc/validation.csv
  - split: test
    path: mrpc/test.csv
---
An MRPC-shaped stand-in written by mixprec's upstream examples benchmark.
"""


def sentence(rng: random.Random) -> str:
    return " ".join(rng.choice(part) for part in (SUBJECTS, VERBS, OBJECTS, ENDINGS)) + "."


def pairs(rng: random.Random, n: int) -> list[dict]:
    rows = []
    for idx in range(n):
        first, label = sentence(rng), idx % 2
        words = first.rstrip(".").split(" ")
        second = " ".join(words[-2:] + words[:-2]) + "." if label else sentence(rng)
        rows.append({"sentence1": first, "sentence2": second, "label": label, "idx": idx})
    return rows


def write_csv(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def write_data(into: Path, train_pairs: int, eval_pairs: int, text_lines: int) -> list[str]:
    """The data files; returns the generated sentences (the tokenizers' training text)."""
    rng = random.Random(0)
    train, validation, test = pairs(rng, train_pairs), pairs(rng, eval_pairs), pairs(rng, eval_pairs)
    glue = into / "nyu-mll" / "glue"
    for split, rows in (("train", train), ("validation", validation), ("test", test)):
        write_csv(glue / "mrpc" / f"{split}.csv", rows)
    (glue / "README.md").write_text(GLUE_README)
    write_csv(into / "pairs" / "train.csv", train)
    write_csv(into / "pairs" / "validation.csv", validation)
    lines = [sentence(rng) for _ in range(text_lines)]
    (into / "text").mkdir(parents=True, exist_ok=True)
    (into / "text" / "train.txt").write_text("\n".join(lines[: text_lines * 4 // 5]) + "\n")
    (into / "text" / "validation.txt").write_text("\n".join(lines[text_lines * 4 // 5 :]) + "\n")
    for name, with_f1 in (("glue", True), ("accuracy", False)):
        metric = ACCURACY_METRIC.format(name=name.title(), with_f1=with_f1, extra_doc=" and f1" if with_f1 else "")
        (into / name).mkdir(exist_ok=True)
        (into / name / f"{name}.py").write_text(metric)
    corpus = [r[k] for r in train + validation + test for k in ("sentence1", "sentence2")] + lines
    return corpus


def write_bert(into: Path, corpus: list[str]) -> None:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertConfig, BertForSequenceClassification, PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=False)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(corpus, trainers.WordPieceTrainer(vocab_size=200, special_tokens=specials))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_max_length=128,
    )
    config = BertConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=128,
        num_labels=2,
        pad_token_id=tok.token_to_id("[PAD]"),
    )
    tokenizer.save_pretrained(into / "bert-base-cased")
    BertForSequenceClassification(config).save_pretrained(into / "bert-base-cased")


def write_gpt2(into: Path, corpus: list[str]) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"]))
    eos = "<|endoftext|>"
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=eos, eos_token=eos, unk_token=eos, model_max_length=128
    )
    config = GPT2Config(
        vocab_size=tok.get_vocab_size(),
        n_positions=128,
        n_embd=64,
        n_layer=2,
        n_head=4,
        bos_token_id=tok.token_to_id(eos),
        eos_token_id=tok.token_to_id(eos),
    )
    tokenizer.save_pretrained(into / "tiny-gpt2")
    GPT2LMHeadModel(config).save_pretrained(into / "tiny-gpt2")


def write_fixtures(into: Path, train_pairs: int = 64, eval_pairs: int = 32, text_lines: int = 400) -> Path:
    """Write every stand-in into ``into`` (the examples' working directory); returns ``into``."""
    import torch

    torch.manual_seed(0)  # the saved weights, so every run of the benchmark starts from the same models
    corpus = write_data(into, train_pairs, eval_pairs, text_lines)
    write_bert(into, corpus)
    write_gpt2(into, corpus)
    return into
