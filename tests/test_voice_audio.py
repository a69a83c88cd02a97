"""models/voice_assistant/audio.py: the whole-clip resampler (soxr) and its contract with the
clips it makes (length, dtype, a band-limited result, no leak from one end of a clip into
the other)."""

from __future__ import annotations

import numpy as np
import pytest

from models.voice_assistant.audio import resample

VOICE = 22_050  # the bundled piper voice's rate
RATES = [(VOICE, 16_000), (VOICE, 24_000), (16_000, 24_000), (24_000, 16_000), (16_000, 22_050), (44_100, 16_000)]


def sine(hz: float, rate: int, n: int, amp: float = 0.5) -> np.ndarray:
    return amp * np.sin(2 * np.pi * hz * np.arange(n) / rate)


@pytest.mark.parametrize(("rate_in", "rate_out"), RATES)
def test_the_length_is_round_of_the_ratio_for_every_clip_length(rate_in: int, rate_out: int) -> None:
    # Every length up to a few hundred takes each rounding case, half samples included
    # (3 samples 16 -> 24 kHz is 4.5: Python's round() says 4, soxr on its own says 5).
    for n in range(1, 400):
        out = resample(np.ones(n), rate_in, rate_out)
        assert len(out) == round(n * rate_out / rate_in), n
        assert out.dtype == np.float64


def test_same_rate_and_empty_clips_come_back_as_float64_copies() -> None:
    x = np.arange(5, dtype=np.int16)
    same = resample(x, VOICE, VOICE)
    assert same.dtype == np.float64 and np.array_equal(same, x)
    assert not np.shares_memory(resample(same, VOICE, VOICE), same)
    empty = resample(np.zeros(0, np.int16), VOICE, 16_000)
    assert empty.dtype == np.float64 and len(empty) == 0


@pytest.mark.parametrize(("rate_in", "rate_out"), RATES)
def test_a_tone_comes_through_clean(rate_in: int, rate_out: int) -> None:
    got = resample(sine(440, rate_in, rate_in), rate_in, rate_out)
    want = sine(440, rate_out, rate_out)
    inner = slice(200, rate_out - 200)  # away from the clip's two edges, where any filter starts up
    err = got[inner] - want[inner]
    assert 10 * np.log10(np.sum(want[inner] ** 2) / np.sum(err**2)) > 80


def test_what_the_lower_rate_cannot_carry_is_filtered_out_not_folded_back() -> None:
    # 10 kHz is above 16 kHz's Nyquist: kept, it would alias to 6 kHz at full strength.
    got = resample(sine(10_000, VOICE, VOICE), VOICE, 16_000)
    assert np.abs(got[200:-200]).max() < 1e-4


def test_the_end_of_a_clip_does_not_leak_into_its_start() -> None:
    """A clip silent at first and loud at its end stays silent at first. A whole-clip FFT
    treats the clip as one period of a loop, so its end rang into its start (about -43 dBFS
    before the voice's first word)."""
    x = np.zeros(VOICE)
    x[VOICE // 2 :] = sine(440, VOICE, VOICE - VOICE // 2, amp=0.8)
    got = resample(x, VOICE, 16_000)
    assert np.abs(got[: 16_000 // 4]).max() < 1e-6
    assert np.abs(got[-4000:]).max() > 0.7  # the loud end itself is there
