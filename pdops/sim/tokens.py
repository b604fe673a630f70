"""Deterministic token counting for the sim, and prompts of an exact token count.

Default scheme: one token per whitespace-separated word (``len(text.split())``).
``make_prompt(n, seed)`` emits exactly ``n`` words, so ``count_tokens(make_prompt(n, s)) == n``.
When the model path holds a HF ``tokenizer.json`` the sim counts with the ``tokenizers``
library instead (see ``Counter``); ``make_prompt`` round-trips only with the word scheme.
"""

from __future__ import annotations

import os
import random

# Short, distinct, lowercase words: none contains whitespace.
VOCAB = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
    "november oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu "
    "red green blue cyan amber ivory onyx pearl ruby jade coral slate olive plum rust sand"
).split()


def count_tokens(text: str) -> int:
    """Number of tokens the sim reports for ``text``: its whitespace-separated words."""
    return len(text.split())


def make_prompt(n_tokens: int, seed: int = 0) -> str:
    """A prompt the sim counts as exactly ``n_tokens`` tokens, the same for the same seed."""
    if n_tokens < 0:
        raise ValueError(f"n_tokens must be >= 0, got {n_tokens}")
    rng = random.Random(seed)
    return " ".join(rng.choice(VOCAB) for _ in range(n_tokens))


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
