"""Tests of the Trace value: validation, derived properties, immutability and equality."""
from __future__ import annotations

import numpy as np
import pytest

from coral.workload import Trace


def make(arrival=(0.0, 1.0, 3.0), prompt=(10, 20, 30), output=(1, 2, 3), window_s=None) -> Trace:
    return Trace(name="t", arrival_s=np.array(arrival), prompt_tokens=np.array(prompt),
                 output_tokens=np.array(output), window_s=window_s)


def test_properties_without_window_use_last_arrival():
    trace = make()
    assert 3 == len(trace)
    assert 3.0 == trace.duration_s
    assert 1.0 == trace.rate_per_s  # 3 requests / 3 s
    assert 20.0 == trace.mean_prompt_tok
    assert 2.0 == trace.mean_output_tok


def test_window_sets_duration_and_rate():
    trace = make(window_s=6.0)
    assert 6.0 == trace.duration_s
    assert 0.5 == trace.rate_per_s


def test_empty_trace_has_zero_rate_and_means():
    trace = make(arrival=(), prompt=(), output=())
    assert (0, 0.0, 0.0, 0.0, 0.0) == (len(trace), trace.duration_s, trace.rate_per_s,
                                       trace.mean_prompt_tok, trace.mean_output_tok)


def test_arrays_are_stored_as_read_only_typed_copies():
    arrival = np.array([0.0, 1.0])
    trace = make(arrival=arrival, prompt=[1, 2], output=[3, 4])
    arrival[0] = 99.0
    assert 0.0 == trace.arrival_s[0]
    assert (np.float64, np.int64, np.int64) == (trace.arrival_s.dtype, trace.prompt_tokens.dtype,
                                               trace.output_tokens.dtype)
    with pytest.raises(ValueError, match="read-only"):
        trace.prompt_tokens[0] = 5


def test_equality_compares_array_values():
    assert make() == make()
    assert make() != make(output=(1, 2, 4))
    assert make() != make(window_s=3.0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"arrival": (0.0, 1.0), "prompt": (1,), "output": (1, 2)}, "same length"),
        ({"arrival": (1.0, 0.5, 2.0)}, "sorted"),
        ({"arrival": (-1.0, 0.5, 2.0)}, "arrival_s must be >= 0"),
        ({"arrival": (0.0, np.nan, 2.0)}, "NaN"),
        ({"prompt": (1, -2, 3)}, "prompt_tokens must be >= 0"),
        ({"output": (1, 2, -3)}, "output_tokens must be >= 0"),
        ({"prompt": (1.5, 2.0, 3.0)}, "whole numbers"),
        ({"window_s": 2.0}, "ends before the last arrival"),
        ({"window_s": -1.0}, "window_s must be"),
    ],
)
def test_invalid_traces_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make(**kwargs)


def test_repr_is_a_summary():
    assert "Trace(name='t', requests=3, duration_s=3.000, rate_per_s=1, mean_prompt_tok=20.0, mean_output_tok=2.0)" == repr(make())
