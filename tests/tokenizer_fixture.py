"""A small real tokenizer for the tests, built with HuggingFace's ``tokenizers``: a word-level
vocabulary over whitespace-split words and punctuation, ChatML's special tokens, and a chat
template written here. The ids are fixed by the vocabulary's order, so a test can write the
ids it expects."""

from __future__ import annotations

import json
import os

from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

WORDS = ["[UNK]", "hello", "world", "you", "are", "a", "bot", "how", "?", "fine", "system", "user", "assistant"]
WORDS += [f"w{i}" for i in range(200)]
SPECIAL = ["<s>", "<|im_start|>", "<|im_end|>"]
VOCAB = {w: i for i, w in enumerate(WORDS)}
# The added tokens take the next ids, in this order.
IDS = {t: len(WORDS) + i for i, t in enumerate(SPECIAL)}

CHATML = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build(directory: str, template: str | None = CHATML, bos: bool = True) -> str:
    """Write tokenizer.json and tokenizer_config.json into ``directory``; returns it."""
    tok = Tokenizer(models.WordLevel(vocab=VOCAB, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    cfg: dict = {"bos_token": {"content": "<s>"} if bos else None, "eos_token": "<|im_end|>"}
    if template is not None:
        cfg["chat_template"] = template
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as fh:
        json.dump(cfg, fh)
    return directory


def ids(*words: str) -> list[int]:
    """The ids of words and special tokens, as the vocabulary numbers them."""
    return [IDS[w] if w in IDS else VOCAB[w] for w in words]
