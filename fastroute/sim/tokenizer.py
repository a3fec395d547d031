"""A real tokenizer for the benchmarks, trained here (nothing is fetched): a 32,000-token
byte-level BPE over the Python standard library's sources, with ChatML's special tokens and
template. ``train(directory)`` writes ``tokenizer.json`` and ``tokenizer_config.json`` once;
the router (``--tokenizer-path``) and the simulated server (``--tokenizer-path``) read them."""

from __future__ import annotations

import glob
import json
import os

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def train(directory: str) -> str:
    """A 32k byte-level BPE trained on the standard library's .py files, saved in ``directory``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if os.path.isfile(os.path.join(directory, "tokenizer.json")):
        return directory
    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=32_000, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.train(files, trainer)
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as fh:
        json.dump({"eos_token": "<|im_end|>", "chat_template": CHATML}, fh)
    return directory
