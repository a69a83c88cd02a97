"""Reply wording, reply pieces for incremental synthesis, and the words of a text for scoring
(word error rate: `clients.eval.metrics.word_error_rate`)."""

from __future__ import annotations

import re

NOT_CAUGHT = "Sorry, I did not catch that."

SAMPLE_SENTENCES = [
    "the weather is nice today",
    "please call my mother tomorrow morning",
    "what time is it",
    "i would like a cup of coffee",
    "turn off the lights in the kitchen",
    "how far is the airport from here",
    "send a message to my brother",
    "play some music in the living room",
]
"""Known sentences the tests and benchmarks synthesize and speak (word error rate, latency)."""


def reply_text(transcript: str) -> str:
    """The spoken reply to a final transcript."""
    words = " ".join(transcript.split())
    if not words:
        return NOT_CAUGHT
    return f"You said: {words}."


def split_pieces(text: str, max_words: int = 10, first_words: int | None = None) -> list[str]:
    """Sentences of `text`, each cut into pieces of at most `max_words` words (synthesis units).
    With `first_words`, the first piece is shorter: up to the first word that ends a clause
    (`,` `:` `;`) within `first_words` words, else `first_words` words. The reply's first audio
    waits on the first piece's synthesis alone ("You said:" takes piper a third of the time
    of the whole sentence), and the rest is synthesized while it plays."""
    pieces: list[str] = []
    for sentence in re.split(r"(?<=[.!?])\s+", text.strip()):
        words = sentence.split()
        start = 0
        if first_words is not None and not pieces and len(words) > first_words:
            ends = [i + 1 for i, w in enumerate(words[:first_words]) if w[-1] in ",:;"]
            start = ends[0] if ends else first_words
            pieces.append(" ".join(words[:start]))
        for i in range(start, len(words), max_words):
            pieces.append(" ".join(words[i : i + max_words]))
    return [p for p in pieces if p]


def normalize(text: str) -> list[str]:
    """Lower-case words, punctuation dropped (apostrophes kept), for scoring."""
    return re.sub(r"[^a-z0-9' ]+", " ", text.lower()).split()
