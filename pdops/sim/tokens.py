"""Deterministic token counting for the sim, and the text of the tokens it generates.

Default scheme: pdops's word scheme (pdops.model.prompts), one token per whitespace-separated word,
so ``count_tokens(make_prompt(n, s)) == n``. When the model path holds a HF ``tokenizer.json`` the
sim counts with the ``tokenizers`` library instead (see ``Counter``); ``make_prompt`` round-trips
only with the word scheme.
"""

from __future__ import annotations

import os

from pdops.model.prompts import VOCAB, count_tokens


def output_word(index: int) -> str:
    """The text of generated token number ``index`` (deterministic)."""
    return VOCAB[index % len(VOCAB)]


class Counter:
    """Counts prompt tokens for one engine: the HF tokenizer in the model path if any,
    else the word scheme. ``kind`` says which was chosen."""

    def __init__(self, model_path: str | None):
        self._tok = None
        self.kind = "words"
        path = os.path.join(model_path or "", "tokenizer.json")
        if model_path and os.path.isfile(path):
            try:
                from tokenizers import Tokenizer

                self._tok = Tokenizer.from_file(path)
                self.kind = "tokenizer.json"
            except Exception:  # a bad file falls back to words, like a missing one
                self._tok = None

    def count(self, text: str) -> int:
        if self._tok is not None:
            return len(self._tok.encode(text, add_special_tokens=False).ids)
        return count_tokens(text)
