"""Tests of the trace file loaders against the real Azure and BurstGPT files and small hand-made CSVs."""
from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest

from coral.errors import CoralError
from coral.workload import load_azure, load_burstgpt, load_csv, load_trace_file

# Facts from coral/data/README.md: requests, prompt mean / median / max, output mean / median / max,
# first and last timestamp (span in seconds, to whole seconds).
AZURE_FACTS = {
    "azure_llm_2023_code.csv.gz": (8819, 2047.8, 1469, 7437, 27.9, 13, 1899, "18:17:03", "19:14:19"),
    "azure_llm_2023_conv.csv.gz": (19366, 1154.7, 1020, 14050, 211.1, 129, 1000, "18:15:46", "19:14:08"),
}


def _seconds(clock: str) -> int:
    h, m, s = (int(x) for x in clock.split(":"))
    return 3600 * h + 60 * m + s


@pytest.mark.parametrize("file", sorted(AZURE_FACTS))
def test_azure_trace_matches_published_statistics(traces_dir: Path, file: str):
    count, p_mean, p_median, p_max, o_mean, o_median, o_max, first, last = AZURE_FACTS[file]
    loaded = load_azure(traces_dir / file)
    trace = loaded.trace
    assert (count, count, 0) == (loaded.rows_read, len(trace), loaded.dropped)
    assert p_mean == round(trace.mean_prompt_tok, 1)
    assert o_mean == round(trace.mean_output_tok, 1)
    assert (p_median, p_max) == (np.median(trace.prompt_tokens), trace.prompt_tokens.max())
    assert (o_median, o_max) == (np.median(trace.output_tokens), trace.output_tokens.max())
    assert 0.0 == trace.arrival_s[0]
    span = trace.arrival_s[-1]
    # Clock times are truncated to whole seconds, so the span is within one second of their difference.
    assert abs(span - (_seconds(last) - _seconds(first))) < 1.0
    # The window is the span plus one mean gap, so the rate is (n - 1) / span.
    assert (count - 1) / span == pytest.approx(trace.rate_per_s, rel=1e-12)


def test_azure_first_row_timing(traces_dir: Path):
    # Rows 1-2 of the code trace: 18:17:03.9799600 and 18:17:04.0319600, 0.052 s apart.
    trace = load_azure(traces_dir / "azure_llm_2023_code.csv.gz").trace
    assert 0.052 == pytest.approx(trace.arrival_s[1], abs=1e-9)
    assert [4808, 3180] == trace.prompt_tokens[:2].tolist()
    assert [10, 8] == trace.output_tokens[:2].tolist()


def test_burstgpt_drops_failed_requests_and_counts_them(traces_dir: Path):
    # README: 400 rows spanning Timestamp 5 -> 37,274 s; 17 rows have 0 request tokens (and, in this
    # slice, 0 response tokens too, so they are failures).
    loaded = load_burstgpt(traces_dir / "burstgpt_1_first400.csv.gz")
    assert (400, 383, 17, 0, 17) == (loaded.rows_read, len(loaded.trace), loaded.dropped_failed,
                                     loaded.dropped_empty_prompt, loaded.dropped)
    assert 0 == int((loaded.trace.output_tokens == 0).sum() + (loaded.trace.prompt_tokens == 0).sum())
    assert (0.0, 37274.0 - 5.0) == (loaded.trace.arrival_s[0], loaded.trace.arrival_s[-1])
    assert "17 failed requests (0 output tokens) dropped" in loaded.describe()


def test_burstgpt_model_filter(traces_dir: Path):
    everything = load_burstgpt(traces_dir / "burstgpt_1_first400.csv.gz")
    chatgpt = load_burstgpt(traces_dir / "burstgpt_1_first400.csv.gz", models=["ChatGPT"])
    gpt4 = load_burstgpt(traces_dir / "burstgpt_1_first400.csv.gz", models=["GPT-4"])
    assert len(everything.trace) == len(chatgpt.trace) + len(gpt4.trace)
    assert 400 == chatgpt.rows_read == chatgpt.filtered_out + chatgpt.dropped + len(chatgpt.trace)
    assert 0 < len(gpt4.trace) < len(everything.trace)


def test_burstgpt_empty_prompt_rows_are_counted_apart_from_failures(write_csv):
    path = write_csv("b.csv", """
        Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type
        10,ChatGPT,100,5,105,Conversation log
        12,ChatGPT,0,7,7,Conversation log
        13,GPT-4,30,0,30,API log
        20,GPT-4,50,9,59,API log
    """)
    loaded = load_burstgpt(path)
    assert (1, 1) == (loaded.dropped_failed, loaded.dropped_empty_prompt)
    assert [0.0, 10.0] == loaded.trace.arrival_s.tolist()
    assert [100, 50] == loaded.trace.prompt_tokens.tolist()


@pytest.mark.parametrize("name", ["trace.csv", "trace.csv.gz", "trace-without-suffix"])
def test_generic_csv_plain_or_gzip_with_named_columns(write_csv, name):
    path = write_csv(name, """
        t,in,out,extra
        2.5,100,7,x
        0.5,40,3,y
        1.0,60,5,z
    """)
    trace = load_csv(path, arrival_column="t", prompt_column="in", output_column="out", name="mine").trace
    assert "mine" == trace.name
    assert [0.5, 1.0, 2.5] == trace.arrival_s.tolist()  # sorted, not rebased
    assert [40, 60, 100] == trace.prompt_tokens.tolist()
    assert [3, 5, 7] == trace.output_tokens.tolist()


def test_gzip_is_detected_by_content_not_name(write_csv, tmp_path):
    plain = write_csv("x.csv", "arrival_s,prompt_tokens,output_tokens\n0,1,2\n1,3,4")
    disguised = tmp_path / "disguised.csv"
    disguised.write_bytes(gzip.compress(plain.read_bytes()))
    assert load_trace_file(plain).trace.arrival_s.tolist() == load_trace_file(disguised).trace.arrival_s.tolist()


def test_autodetect_recognises_each_format(traces_dir: Path, write_csv):
    assert "azure" == load_trace_file(traces_dir / "azure_llm_2023_code.csv.gz").format
    assert "burstgpt" == load_trace_file(traces_dir / "burstgpt_1_first400.csv.gz").format
    generic = write_csv("g.csv", "arrival_s,prompt_tokens,output_tokens\n0,1,2")
    assert "csv" == load_trace_file(generic).format
    renamed = write_csv("r.csv", "a,p,o\n0,1,2")
    assert [1] == load_trace_file(renamed, columns=("a", "p", "o")).trace.prompt_tokens.tolist()


def test_azure_loader_sorts_out_of_order_rows(write_csv):
    path = write_csv("az.csv", """
        TIMESTAMP,ContextTokens,GeneratedTokens
        2023-11-16 18:00:02.5000000,30,3
        2023-11-16 18:00:00.0000000,10,1
        2023-11-16 18:00:01.0000000,20,2
    """)
    trace = load_azure(path).trace
    assert [0.0, 1.0, 2.5] == trace.arrival_s.tolist()
    assert [10, 20, 30] == trace.prompt_tokens.tolist()
    assert 2.5 + 1.25 == trace.window_s  # span + one mean gap


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(CoralError, match=r"trace file not found: .*nope\.csv"):
        load_trace_file(tmp_path / "nope.csv")


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("a,b,c\n1,2,3", r"unrecognised trace columns 'a', 'b', 'c'.*columns:"),
        ("", "the file is empty"),
        ("arrival_s,prompt_tokens,output_tokens\n0,-5,2", r"line 2, column 'prompt_tokens': token count -5 is negative"),
        ("arrival_s,prompt_tokens,output_tokens\n0,5,2\n1,nan,2", r"line 3, column 'prompt_tokens': 'nan' is NaN"),
        ("arrival_s,prompt_tokens,output_tokens\n0,5,2\n1,5,two", r"line 3, column 'output_tokens': 'two' is not a number"),
        ("arrival_s,prompt_tokens,output_tokens\n0,5.5,2", r"5.5 is not a whole number"),
        ("arrival_s,prompt_tokens,output_tokens\n-1,5,2", r"arrival time -1 is negative.*start at 0"),
        ("arrival_s,prompt_tokens,output_tokens\n0,5", r"line 2: the row has 2 fields but column 'output_tokens'"),
    ],
)
def test_bad_generic_csv_names_file_line_and_column(write_csv, text, match):
    path = write_csv("bad.csv", text) if text else write_csv("bad.csv", " ")
    with pytest.raises(CoralError, match=match) as info:
        load_trace_file(path)
    assert "bad.csv" in str(info.value)


def test_named_column_missing_lists_the_columns(write_csv):
    path = write_csv("c.csv", "time,p,o\n0,1,2")
    with pytest.raises(CoralError, match=r"no column 'arrival'; its columns are 'time', 'p', 'o'\. name the columns"):
        load_csv(path, arrival_column="arrival", prompt_column="p", output_column="o")


def test_bad_azure_timestamp_names_the_line(write_csv):
    path = write_csv("az.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00.0,1,1\nyesterday,1,1")
    with pytest.raises(CoralError, match=r"az\.csv, line 3, column 'TIMESTAMP': 'yesterday' is not a timestamp"):
        load_azure(path)


def test_azure_file_missing_a_column(write_csv):
    path = write_csv("az.csv", "TIMESTAMP,ContextTokens\n2023-11-16 18:00:00.0,1")
    with pytest.raises(CoralError, match=r"no column 'GeneratedTokens'.*TIMESTAMP, ContextTokens, GeneratedTokens"):
        load_azure(path)


def test_truncated_gzip_is_reported(tmp_path):
    path = tmp_path / "cut.csv.gz"
    path.write_bytes(gzip.compress(b"arrival_s,prompt_tokens,output_tokens\n" * 50)[:30])
    with pytest.raises(CoralError, match=r"cut\.csv\.gz: cannot read the file"):
        load_trace_file(path)
