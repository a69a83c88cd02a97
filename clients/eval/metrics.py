"""Quality figures: word error rate (jiwer) and echo's byte-exact check."""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING

import numpy as np

from clients.eval.extra import needed

if TYPE_CHECKING:
    import jiwer


@cache
def _words() -> jiwer.Compose:
    """Lower case, punctuation dropped (apostrophes kept), words split on spaces: "You said:
    It's ON." scores as "you said it's on". Built on first use: jiwer is the eval extra's."""
    with needed():
        import jiwer

    return jiwer.Compose(
        [
            jiwer.ToLowerCase(),
            jiwer.SubstituteRegexes({r"[^a-z0-9' ]+": " "}),
            jiwer.RemoveMultipleSpaces(),
            jiwer.Strip(),
            jiwer.ReduceToListOfListOfWords(),
        ]
    )


def word_error_rate(refs: list[str], hyps: list[str]) -> tuple[float, int, int]:
    """(WER, word errors, reference words) over paired references and hypotheses, counted over
    all pairs together. A pair whose reference has no words is left out (no rate exists)."""
    with needed():
        import jiwer

    norm = _words()
    pairs = [(r, h) for r, h in zip(refs, hyps, strict=True) if norm(r) != [[]]]
    if not pairs:
        return 0.0, 0, 0
    out = jiwer.process_words([r for r, _ in pairs], [h for _, h in pairs], reference_transform=norm, hypothesis_transform=norm)
    errors = out.substitutions + out.deletions + out.insertions
    words = out.substitutions + out.deletions + out.hits
    return errors / words, errors, words


def echo_exact(sent: np.ndarray, reply: np.ndarray) -> bool:
    """Whether `reply` is `sent` byte for byte, allowing only zeros after it (echo pads the
    last frame of a call with zeros)."""
    sent = np.asarray(sent, "<i2")
    reply = np.asarray(reply, "<i2")
    if len(reply) < len(sent):
        return False
    return bool(np.array_equal(reply[: len(sent)], sent) and not reply[len(sent) :].any())
