"""The integration suite's own rules (tests/integration/conftest.py), checked natively: its pytest hooks do
what their options promise. (A module's second ``pytest_configure`` replaces its first: ``--framing`` then
did nothing, and the header-framing job ran the immediate framing.)"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

import rdmaio.options

CONFTEST = Path(__file__).resolve().parents[1] / "integration" / "conftest.py"


def load_conftest() -> ModuleType:
    """tests/integration/conftest.py as a module of its own (not registered with this pytest run)."""
    spec = importlib.util.spec_from_file_location("integration_conftest_under_test", CONFTEST)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_framing_option_becomes_the_default_framing(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--framing=header`` sets ``RDMAIO_FRAMING`` and the package's default Options (what every
    connection of the run and every peer process it starts uses); the provider markers are registered by
    the same hook."""
    monkeypatch.setenv("RDMAIO_FRAMING", "auto")  # restored after the test, as is the default Options
    monkeypatch.delenv("RDMAIO_FRAMING")
    monkeypatch.setattr(rdmaio.options, "_DEFAULTS", rdmaio.options._DEFAULTS)
    markers: list[str] = []
    config = SimpleNamespace(
        getoption=lambda name: "header" if name == "--framing" else None,
        addinivalue_line=lambda name, line: markers.append(line),
    )
    load_conftest().pytest_configure(config)
    assert os.environ.get("RDMAIO_FRAMING") == "header"
    assert rdmaio.options._DEFAULTS.framing == "header"
    assert any(line.startswith("requires_atomics") for line in markers), markers
