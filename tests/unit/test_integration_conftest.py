"""The integration suite's conftest: its one ``pytest_configure`` both registers the provider markers and
applies ``--framing`` (CI's header-framing job runs the provider suites with ``--framing=header``). A
second hook of the same name in that module replaced the first, so the option did nothing and that job
ran the immediate framing."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import ModuleType

import rdmaio.options

CONFTEST = Path(__file__).resolve().parents[1] / "integration" / "conftest.py"


def _integration_conftest() -> ModuleType:
    spec = importlib.util.spec_from_file_location("integration_conftest", CONFTEST)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Config:
    """What the hook uses of pytest's config: the option's value and marker registration."""

    def __init__(self, framing: str | None) -> None:
        self.framing = framing
        self.lines: list[tuple[str, str]] = []

    def getoption(self, name: str) -> str | None:
        assert name == "--framing"
        return self.framing

    def addinivalue_line(self, name: str, line: str) -> None:
        self.lines.append((name, line))


def test_framing_option_and_provider_markers_both_apply() -> None:
    module = _integration_conftest()
    saved_env, saved_defaults = os.environ.get("RDMAIO_FRAMING"), rdmaio.options._DEFAULTS
    try:
        os.environ.pop("RDMAIO_FRAMING", None)
        config = _Config("header")
        module.pytest_configure(config)
        assert os.environ.get("RDMAIO_FRAMING") == "header"
        assert rdmaio.options._DEFAULTS.framing == "header"
        markers = [line.split(":")[0] for name, line in config.lines if name == "markers"]
        assert {"requires_immediate", "requires_atomics", "requires_memory_windows"} <= set(markers)
        assert any(marker.startswith("provider(") for marker in markers)
    finally:
        if saved_env is None:
            os.environ.pop("RDMAIO_FRAMING", None)
        else:
            os.environ["RDMAIO_FRAMING"] = saved_env
        rdmaio.options._DEFAULTS = saved_defaults
