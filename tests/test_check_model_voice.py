"""`duplexbus check-model voice_assistant`: its three partitions (real silero-vad,
pocketsphinx and piper, loaded for the run) pass on a few short generated calls. Apart from
tests/test_check_model.py because loading the speech models takes seconds."""

from __future__ import annotations

import pytest

from duplexbus.check_model import Options, check

pytestmark = pytest.mark.slow


def test_voice_assistant_passes_on_a_few_short_calls() -> None:
    report = check("voice_assistant", Options(calls=4, appends=2, items=4, seed=3))
    assert report.violations == [], report.violations
    assert set(report.figures) == {"Listener", "Recognizer", "Talker"}
    assert report.figures["Listener"]["steps"] > 0
