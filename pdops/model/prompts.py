"""Prompts of an exact length in pdops's word scheme: one token per whitespace-separated word.

The bench's load, the probe's requests and the lab's canaries write prompts this way, and the sim
(pdops.sim.tokens) counts a prompt's tokens the same way, so a prompt of N words is N tokens there.
A real engine's tokenizer counts differently (SGLang reports the count it saw: the bench reads it
back, docs/bench.md). ``make_prompt(n, seed)`` emits exactly ``n`` words, the same for one seed.
"""

from __future__ import annotations

import random

# Short, distinct, lowercase words: none contains whitespace.
VOCAB = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
    "november oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu "
    "red green blue cyan amber ivory onyx pearl ruby jade coral slate olive plum rust sand"
).split()


def count_tokens(text: str) -> int:
    """The length of ``text`` in the word scheme: its whitespace-separated words."""
    return len(text.split())


def make_prompt(n_tokens: int, seed: int = 0) -> str:
    """A prompt of exactly ``n_tokens`` words (tokens in the word scheme), the same for the same seed."""
    if n_tokens < 0:
        raise ValueError(f"n_tokens must be >= 0, got {n_tokens}")
    rng = random.Random(seed)
    return " ".join(rng.choice(VOCAB) for _ in range(n_tokens))
