"""The experiments' progress: a library unit built in parallel (first report done > 1) gets its own line."""
from __future__ import annotations

from types import SimpleNamespace

from coral.experiments.runner import RunConfig, Session
from coral.perf import Phase


class RecordingUi:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def start(self, description: str, total: float) -> None:
        self.calls.append(("start", description, total))

    def update(self, completed: float) -> None:
        self.calls.append(("update", completed))

    def note(self, message: str) -> None:
        self.calls.append(("note", message))


def test_each_library_unit_starts_its_own_bar_even_when_built_in_chunks():
    ui = RecordingUi()
    session = Session(config=RunConfig.make("core", quick=True), ui=ui)
    pre = SimpleNamespace(model=SimpleNamespace(name="qwen3-32b"), phase=Phase.PREFILL)
    dec = SimpleNamespace(model=SimpleNamespace(name="qwen3-32b"), phase=Phase.DECODE)
    for spec in (pre, dec):
        for done in (64, 128, 200):  # a parallel build's chunks: the first report is already 64
            session._library_step(spec, done, 200)
    starts = [c for c in ui.calls if c[0] == "start"]
    assert [("start", "templates qwen3-32b prefill", 200), ("start", "templates qwen3-32b decode", 200)] == starts
    assert 6 == sum(1 for c in ui.calls if c[0] == "update")
