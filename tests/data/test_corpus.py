"""The default corpus, the user-data loaders, the byte tokenizer, the split and the unigram baseline."""

from __future__ import annotations

import json
import math
import re
from collections import Counter

import pytest
import torch

from mixprec.data import (
    DEFAULT_CORPUS_BYTES,
    UNIFORM_LOSS,
    VOCAB_SIZE,
    decode,
    encode,
    load_corpus,
    load_text_corpus,
    split_train_val,
    stdlib_corpus,
    unigram_entropy,
)
from mixprec.data import corpus as corpus_mod

# --- the default corpus ---------------------------------------------------------------------------------


def test_default_corpus_is_deterministic_and_capped():
    first = stdlib_corpus()
    corpus_mod._stdlib_corpus_cached.cache_clear()  # read the disk again, not the cache
    second = stdlib_corpus()
    assert first is not second and first.data == second.data
    # the standard library is larger than the cap, so the cap is met exactly
    assert len(first) == DEFAULT_CORPUS_BYTES
    assert "standard library" in first.source and first.num_documents > 50


def test_a_smaller_cap_is_a_prefix_of_a_larger_one():
    small, large = stdlib_corpus(10_000), stdlib_corpus(50_000)
    assert len(small) == 10_000 and len(large) == 50_000
    assert large.data.startswith(small.data)
    with pytest.raises(ValueError, match="max_bytes"):
        stdlib_corpus(0)


def test_default_corpus_is_sorted_library_source_without_tests_or_third_party():
    whole = stdlib_corpus(10**9)  # all of it
    paths = re.findall(rb"^# ---- (.+?) ----$", whole.data, flags=re.M)
    paths = [p.decode() for p in paths if p.endswith(b".py")]
    assert len(paths) == whole.num_documents
    assert paths == sorted(paths)
    assert "os.py" in paths and "collections/__init__.py" in paths
    for p in paths:
        parts = p.split("/")
        assert not {"test", "tests", "site-packages", "encodings"} & set(parts[:-1]), p
        assert not parts[-1].startswith("_sysconfigdata"), p


def test_load_corpus_without_a_path_is_the_default():
    assert load_corpus().data == stdlib_corpus().data
    assert load_corpus(max_bytes=1234).data == stdlib_corpus(1234).data


# --- tokenizer -----------------------------------------------------------------------------------------


def test_encode_decode_round_trip_is_byte_level():
    text = "def f(x):\n    return 'héllo ✓'\n"
    ids = encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < VOCAB_SIZE
    assert decode(ids) == text
    assert decode(torch.tensor(ids)) == text
    assert encode(b"\x00\xff") == [0, 255]


def test_decode_replaces_a_cut_character_instead_of_raising():
    ids = encode("✓")[:2]  # a sample cut mid-character
    assert decode(ids) == "\ufffd"
    with pytest.raises(ValueError, match=r"\[0, 255\]"):
        decode([65, 300])


# --- user data -----------------------------------------------------------------------------------------


def test_load_a_text_file(tmp_path):
    f = tmp_path / "a.txt"
    f.write_bytes(b"hello world\n")
    c = load_text_corpus(f)
    assert c.data == b"hello world\n" and c.num_documents == 1
    assert load_text_corpus(f, max_bytes=5).data == b"hello"


def test_load_a_folder_recursively_in_sorted_order(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / ".git").mkdir()
    (tmp_path / "b.txt").write_text("B")
    (tmp_path / "a.txt").write_text("A")
    (tmp_path / "sub" / "c.md").write_text("C")
    (tmp_path / ".git" / "HEAD").write_text("hidden")
    (tmp_path / ".hidden.txt").write_text("hidden")
    (tmp_path / "image.bin").write_bytes(b"\x89PNG\x00\x00data")
    (tmp_path / "empty.txt").write_text("")
    c = load_text_corpus(tmp_path)
    assert c.data == b"A\n\nB\n\nC"  # a.txt, b.txt, sub/c.md; hidden, binary and empty skipped
    assert c.num_documents == 3


def test_load_jsonl_with_default_and_custom_field(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"text": "one", "id": 1}) + "\n\n" + json.dumps({"text": "twö"}) + "\n")
    assert load_text_corpus(f).data == "one\n\ntwö".encode()
    g = tmp_path / "e.jsonl"
    g.write_text(json.dumps({"content": "x"}) + "\n" + json.dumps({"content": "y"}) + "\n")
    assert load_text_corpus(g, text_field="content").data == b"x\n\ny"


def test_jsonl_line_without_the_field_names_the_line(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"body": "no"}) + "\n")
    with pytest.raises(ValueError, match=r"line 2 has no 'text' field \(found: body\).*--text-field"):
        load_text_corpus(f)
    f.write_text(json.dumps({"text": "ok"}) + "\n{not json\n")
    with pytest.raises(ValueError, match="line 2 is not valid JSON"):
        load_text_corpus(f)
    f.write_text(json.dumps({"text": 3}) + "\n")
    with pytest.raises(ValueError, match="line 1: field 'text' must be a string"):
        load_text_corpus(f)


def test_missing_path_and_empty_corpus_errors(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError, match=f"--data: no such file or folder: {re.escape(str(missing))}"):
        load_text_corpus(missing)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="corpus is empty"):
        load_text_corpus(tmp_path / "empty.txt")
    (tmp_path / "dir").mkdir()
    with pytest.raises(ValueError, match="corpus is empty"):
        load_text_corpus(tmp_path / "dir")


# --- split and baseline --------------------------------------------------------------------------------


def test_split_is_the_last_fraction_as_uint8():
    data = bytes(range(256)) * 4  # 1024 bytes
    train, val = split_train_val(data)
    assert train.dtype == val.dtype == torch.uint8
    assert (len(train), len(val)) == (922, 102)
    assert bytes(train.tolist()) + bytes(val.tolist()) == data
    train2, val2 = split_train_val(data, 0.25)
    assert (len(train2), len(val2)) == (768, 256)
    assert torch.equal(split_train_val(data)[1], val)  # deterministic
    assert len(split_train_val(data, 0.0)[1]) == 0
    assert len(split_train_val(b"abc", 0.1)[1]) == 1  # a requested validation set is never empty
    with pytest.raises(ValueError, match="val_fraction"):
        split_train_val(data, 1.0)


def test_corpus_split_matches_the_function():
    c = stdlib_corpus(20_000)
    train, val = c.split()
    assert len(train) == 18_000 and len(val) == 2_000
    assert bytes(val.tolist()) == c.data[18_000:]


def test_unigram_entropy_is_the_byte_entropy_in_nats():
    assert unigram_entropy(bytes(range(256))) == pytest.approx(UNIFORM_LOSS) == pytest.approx(math.log(256))
    assert unigram_entropy(b"aaaa") == 0.0
    assert unigram_entropy(b"abab") == pytest.approx(math.log(2))
    text = b"the quick brown fox jumps over the lazy dog"
    n = len(text)
    expected = -sum(c / n * math.log(c / n) for c in Counter(text).values())
    assert unigram_entropy(torch.tensor(list(text), dtype=torch.uint8)) == pytest.approx(expected)
    # Python source is far from uniform: the baseline a model must beat is well under ln 256
    assert 2.5 < unigram_entropy(stdlib_corpus(100_000).data) < 4.0
    with pytest.raises(ValueError, match="empty"):
        unigram_entropy(b"")
