"""The coordinator records what the live planner needs: each accepted request's arrival, prompt length
and generated tokens, per epoch (`Coordinator.observe_epoch`, `RequestWindow`)."""
from __future__ import annotations

import pytest

from coral.runtime.protocol import InstanceHello, InstancePhase, TokenOut
from coral.runtime.serving.coordinator import Coordinator, ModelInfo
from coral.runtime.serving.window import RequestWindow
from coral.runtime.transport import InprocHub, InprocTransport


def test_the_coordinator_records_each_accepted_request_for_the_epoch_window() -> None:
    hub = InprocHub()
    sched = InprocTransport(hub, "S")
    coord = Coordinator(InprocTransport(hub, "C"), [ModelInfo(name="m", max_context=256, vocab_size=100)])
    coord.register(InstanceHello(instance_id="S", model="m", phase=InstancePhase.MIXED, region="r",
                                 throughput_tok_per_s=1.0, address="S"))
    coord.submit("m", [1, 2, 3], max_tokens=4, temperature=0.0, seed=0)
    coord.submit("m", [1] * 7, max_tokens=2, temperature=0.0, seed=0)
    first, second = sched.recv(1.0), sched.recv(1.0)
    coord.handle(TokenOut(request_id=first.request_id, tokens=(5, 6, 7, 8), finished=True, finish_reason="length"))
    coord.handle(TokenOut(request_id=second.request_id, tokens=(5,), finished=False))  # still running
    seen = coord.observe_epoch()
    w = seen.window["m"]
    assert [3, 7] == w.prompt_tokens.tolist()
    assert [4, 1] == w.output_tokens.tolist()  # a running request counts what it has made so far
    assert 0 <= w.arrival_s[0] <= w.arrival_s[1] <= seen.epoch_s == pytest.approx(w.window_s)
    assert pytest.approx(10 / seen.epoch_s) == seen.demand_tok_per_s["m"]["prefill"]
    nothing = coord.observe_epoch()  # a new epoch: nothing arrived in it
    assert 0 == len(nothing.window["m"]) and 0.0 == nothing.demand_tok_per_s["m"]["prefill"]


def test_the_window_keeps_at_most_keep_s_and_every_model_gets_one() -> None:
    rec = RequestWindow(["a", "b"], t0=0.0, keep_s=10.0)
    for t in (1.0, 5.0, 12.0, 14.0):
        rec.record("a", t, 8, [0, 0])
    w = rec.take(15.0)
    # at 14 s the window starts at 4 s (keep_s before): the arrival at 1 s fell out, the others count from 4 s
    assert [1.0, 8.0, 10.0] == w["a"].arrival_s.tolist() and 11.0 == w["a"].window_s
    assert 0 == len(w["b"]) and 11.0 == w["b"].window_s
    assert 0 == len(rec.take(20.0)["a"])
    with pytest.raises(ValueError, match="keep_s"):
        RequestWindow(["a"], t0=0.0, keep_s=0.0)


def test_a_closed_request_leaves_its_token_count_in_the_window_not_its_tokens() -> None:
    """The window holds an hour of requests whether or not a planner takes it: a finished one keeps a
    count (~90 B a request), not the list of its tokens (~1 KiB, which grew the chaos soak's server)."""
    hub = InprocHub()
    sched = InprocTransport(hub, "S")
    coord = Coordinator(InprocTransport(hub, "C"), [ModelInfo(name="m", max_context=256, vocab_size=100)])
    coord.register(InstanceHello(instance_id="S", model="m", phase=InstancePhase.MIXED, region="r",
                                 throughput_tok_per_s=1.0, address="S"))  # fmt: skip
    done = coord.submit("m", [1, 2, 3], max_tokens=4, temperature=0.0, seed=0)
    running = coord.submit("m", [1] * 7, max_tokens=2, temperature=0.0, seed=0)
    first, second = sched.recv(1.0), sched.recv(1.0)
    coord.handle(TokenOut(request_id=first.request_id, tokens=(5, 6, 7, 8), finished=True, finish_reason="length"))
    coord.handle(TokenOut(request_id=second.request_id, tokens=(5,), finished=False))
    entry_done, entry_running = done.window, running.window
    assert entry_done is not None and entry_running is not None
    coord.close(done)
    assert (4, [5]) == (entry_done.generated, entry_running.generated)  # the running one still grows
    coord.handle(TokenOut(request_id=second.request_id, tokens=(6,), finished=True, finish_reason="length"))
    coord.close(running)
    assert (4, 2) == (entry_done.generated, entry_running.generated)
    assert [4, 2] == coord.observe_epoch().window["m"].output_tokens.tolist()
