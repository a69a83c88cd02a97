"""The `duplexbus` command's own handling: bad arguments are one line and exit 2."""

from __future__ import annotations

import pytest

from duplexbus.cli import main


def test_up_with_an_unknown_model_is_a_config_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["up", "--model", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error: model: unknown model 'nope'; served: ")
    assert "Traceback" not in err and err.count("\n") == 1


def test_main_routes_warnings_to_logging(caplog: pytest.LogCaptureFixture) -> None:
    """The `duplexbus` console script calls main() directly: main itself captures warnings."""
    import logging
    import warnings

    logging.captureWarnings(False)
    try:
        main(["up", "--model", "nope"])
        with caplog.at_level(logging.WARNING, logger="py.warnings"):
            warnings.warn("routed to logging", UserWarning, stacklevel=1)
        assert "routed to logging" in caplog.text
    finally:
        logging.captureWarnings(False)
