"""The Hugging Face tokenizer folder made from a GGUF (meshnode/mesh/hf_folder.py), for Dynamo's frontend: it
tokenizes the real model's prompts exactly as llama.cpp does (special tokens, unicode, digits, code, spaces), and
what it cannot make it refuses naming it."""
import json
import random

import pytest

from meshnode.mesh import hf_folder
from meshnode.ops.models import make_model
from meshnode.ops.realmodel import real_model
from meshnode.text.tokenizer import Tokenizer as LlamaTokenizer

tokenizers = pytest.importorskip("tokenizers", reason="the dynamo extra is not installed")

PROMPTS = [
    "Hello, world! 12345 apples and 3.14159, 1,000,000",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat's 2+2? Déjà vu — 東京 🚀"
    "<|im_end|>\n<|im_start|>assistant\n",
    "def f(x):\n    return x**2  # squared\n\n\n\tclass A(B):\n        pass\n",
    "   leading spaces, trailing   ", "I'll we've they're DON'T Can't", "<|endoftext|>a<|im_end|><|im_start|>",
    "naïve café Ωμέγα Привет мир مرحبا 😀😃 \u200b zero-width", "x" * 300 + " " + "9" * 50,
]


def _random_texts(n: int, seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    alphabet = "abcXYZ 0123456789\n\t.,;:'\"!?()[]{}<>|_-+*/=éßΩ東京🚀 "
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 80))) for _ in range(n)]


def test_the_folder_tokenizes_the_real_models_prompts_as_llama_cpp(tmp_path):
    path = str(real_model("smollm2"))
    out = hf_folder.write(path, str(tmp_path / "hf"))
    hf = tokenizers.Tokenizer.from_file(f"{out}/tokenizer.json")
    ll = LlamaTokenizer(path)
    try:
        for text in [*PROMPTS, *_random_texts(200)]:
            assert hf.encode(text, add_special_tokens=False).ids == ll._tokenize(text, False, special=True), text
        config = json.load(open(f"{out}/tokenizer_config.json"))
        assert "<|im_start|>" in config["chat_template"] and config["eos_token"] == "<|im_end|>"
        assert json.load(open(f"{out}/config.json"))["model_type"] == "llama"
    finally:
        ll.close()


def test_a_vocabulary_it_cannot_make_is_refused_naming_it(tmp_path):
    spm = str(make_model(str(tmp_path / "spm.gguf"), "tiny", 0))
    with pytest.raises(ValueError, match="only byte-level BPE vocabularies .* 'llama'"):
        hf_folder.write(spm, str(tmp_path / "out"))
