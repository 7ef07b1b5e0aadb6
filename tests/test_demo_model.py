"""Demo GGUF files: deterministic, loadable, and tokenizing any text."""
import hashlib

import pytest

from meshnode.ops.models import build_vocab, make_model
from meshnode.text.tokenizer import TextStream, Tokenizer


def digest(p):
    return hashlib.sha256(open(p, "rb").read()).hexdigest()


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path, tiny_model):
    a = make_model(tmp_path / "a.gguf", "tiny", 0)
    b = make_model(tmp_path / "b.gguf", "tiny", 1)
    assert digest(a) == digest(tiny_model) and digest(b) != digest(a)
    assert 5_000_000 < a.stat().st_size < 20_000_000


def test_vocab_is_byte_level_spm():
    tokens, scores, types = build_vocab(512)
    assert tokens[:3] == ["<unk>", "<s>", "</s>"] and tokens[3] == "<0x00>" and tokens[258] == "<0xFF>"
    assert len(tokens) == len(scores) == len(types) == 512


def test_any_text_tokenizes_and_round_trips(tiny_model):
    tok = Tokenizer(tiny_model)
    try:
        for text in ["hello mesh node", "Grüße, 世界! 🙂", "  spaced\ttabs\nnewline"]:
            ids = tok.encode(text)
            assert ids[0] == 1 and all(0 <= t < tok.n_vocab for t in ids)
            assert tok.decode(ids[1:]).strip() == text.strip()
        stream = TextStream(tok)
        ids = tok.encode("世界", add_bos=False)
        assert "".join(stream.feed([t]) for t in ids) == tok.decode(ids)  # never splits a character
    finally:
        tok.close()


def test_the_quick_tensor_table_is_the_gguf_packages_and_refuses_what_is_not_gguf(tiny_model, tmp_path):
    from gguf import GGUFReader

    from meshnode.engine.ggufinfo import GGUFError, tensors

    assert tensors(str(tiny_model)) == [(t.name, tuple(map(int, t.shape)), t.tensor_type.name)
                                        for t in GGUFReader(str(tiny_model)).tensors]
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(GGUFError, match="magic"):
        tensors(str(junk))
