"""The stream's text grown a window at a time (``tokenizer.IncrementalText``) against the
whole decode it replaces: at every length a prefix of it, equal to it once no character is
half in; for byte-level BPE (Qwen, Llama 3) and SentencePiece-style Metaspace decoders (Llama 2,
Mistral: a first token's leading space), with special tokens skipped or kept, on text with
multi-byte characters and on random ids that split them."""
from __future__ import annotations

import random

import pytest

from gpu_anchor.serve.tokenizer import Codec, IncrementalText
from gpu_anchor.testing.tiny import TEXT, train_tokenizer

SAMPLE = ("Hello world! Café, naïve, 東京 and 🚀 rockets. The quick brown fox jumps over the lazy dog.\n"
          "  Indented   spaces,\ttabs and ünïcödé.") * 3


def _metaspace(path: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"] +
                                  [f"<0x{b:02X}>" for b in range(256)], show_progress=False)
    tok.train_from_iterator([TEXT, SAMPLE], trainer)
    tok.save(path)


@pytest.fixture(scope="module", params=["byte-level", "metaspace"])
def codec(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    (train_tokenizer(384, str(d / "tokenizer.json")) if request.param == "byte-level"
     else _metaspace(str(d / "tokenizer.json")))
    return Codec(str(d), 384)


@pytest.mark.parametrize("skip", [True, False])
def test_text_grown_by_windows_is_the_whole_decode(codec, skip):
    ids = codec.encode(SAMPLE)
    ids = ids[:40] + [2] + ids[40:]                     # a special token inside the reply
    inc = IncrementalText(codec, skip)
    for n in range(len(ids) + 1):
        whole, grown = codec.decode(ids[:n], skip), inc.update(ids[:n])
        assert whole.startswith(grown), n
        assert whole[len(grown):].strip("\ufffd") == "", (n, whole[len(grown):])   # only a character half in
    assert inc.update(ids) == codec.decode(ids, skip)


def test_random_ids_that_split_characters(codec):
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(3, 384) for _ in range(rng.randrange(1, 60))]
        inc = IncrementalText(codec)
        for n in range(1, len(ids) + 1):
            whole, grown = codec.decode(ids[:n]), inc.update(ids[:n])
            assert whole.startswith(grown), (ids[:n], whole, grown)


def test_a_list_that_shrinks_starts_over(codec):
    ids = codec.encode("one two three four")
    inc = IncrementalText(codec)
    inc.update(ids)
    assert inc.update(ids[:2]) == codec.decode(ids[:2])
