"""rich, matplotlib and jiwer are the `eval` extra's (clients/eval/extra.py): the server and
its CLI work without them, and the eval, missing one, says in one line how to get it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from clients.eval import extra
from clients.eval.metrics import word_error_rate

INSTALL = "pip install 'duplexbus[eval]'"

# A Python where the extra was never installed: an import of any of its modules fails as it
# would there (None in sys.modules halts the import with ModuleNotFoundError).
WITHOUT_EXTRA = "import sys\nfor m in {modules!r}: sys.modules[m] = None\n"


def test_word_error_rate_without_jiwer_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "jiwer", None)
    with pytest.raises(ModuleNotFoundError, match=r"jiwer comes with duplexbus's eval extra: pip install 'duplexbus\[eval\]'"):
        word_error_rate(["a reference"], ["a hypothesis"])


def test_a_missing_dependency_of_the_extra_passes_as_it_is() -> None:
    """Only the extra's own modules are told to install it: anything else is a real error."""
    with pytest.raises(ModuleNotFoundError) as raised, extra.needed():
        import duplexbus_no_such_module  # type: ignore[import-not-found]  # noqa: F401
    assert raised.value.name == "duplexbus_no_such_module" and INSTALL not in str(raised.value)


def test_with_the_extra_installed_nothing_is_missing() -> None:
    assert extra.missing() == []


def _cli(code: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    script = WITHOUT_EXTRA.format(modules=extra.MODULES) + code
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path)


def test_the_cli_without_the_extra_serves_and_the_eval_says_in_one_line_how_to_get_it(tmp_path: Path) -> None:
    # The parser (every command's, the eval's included) is built without the extra.
    helped = _cli("from duplexbus.cli import main\nmain(['eval', '--help'])", tmp_path)
    assert helped.returncode == 0, helped.stderr
    assert "--synthesize" in helped.stdout

    out = tmp_path / "eval-out"
    ran = _cli(f"from duplexbus.cli import main\nmain(['eval', '--synthesize', '1', '--out', {str(out)!r}])", tmp_path)
    assert ran.returncode == 1
    assert ran.stderr.strip().splitlines() == [f"duplexbus eval needs rich, matplotlib, jiwer, from its eval extra: {INSTALL}"]
    assert not out.exists()  # said before anything was done
