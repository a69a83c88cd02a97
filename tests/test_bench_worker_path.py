"""`bench/worker_path.py`: a worker's per-item path measured in-process (no bus), echo's two
partitions. Tiny here: it runs, every item makes its edge item and its output (the
benchmark asserts both), and the figures are CPU times of a plausible size."""

from __future__ import annotations

import math

import pytest

from bench import worker_path


@pytest.mark.parametrize("binary", [False, True])
async def test_the_worker_path_benchmark_steps_every_item_through_both_partitions(binary: bool) -> None:
    best = await worker_path.run(calls=6, rounds=3, batch=4, repeats=1, binary=binary)
    assert set(best) == {"Encoder", "Talker"}
    for us in best.values():
        assert math.isfinite(us) and 0 < us < 1e5


@pytest.mark.parametrize("argv", [["--calls", "0"], ["--batch", "0"], ["--rounds", "-1"], ["--repeats", "0"]])
def test_the_worker_path_benchmark_refuses_what_it_cannot_measure(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        worker_path.cli(argv)
    assert e.value.code == 2 and "must be at least 1" in capsys.readouterr().err
