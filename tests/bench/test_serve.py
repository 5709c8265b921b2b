"""scripts/bench-serve.sh's driver without AIPerf or a server: the AIPerf command, the prompts file, the summary rows
read from a profile_export_aiperf.json, the table, and the options."""

import json
from pathlib import Path

import pytest

from specbuild.bench.serve.__main__ import parse_args
from specbuild.bench.serve.aiperf_run import aiperf_command, shell_line
from specbuild.bench.serve.dataset import dataset_args
from specbuild.bench.serve.run import engine_labels
from specbuild.bench.serve.server_process import metric_sums
from specbuild.bench.serve.summary import SPEC_COUNTERS, markdown_table, spec_decode_counts, speedups, summary_row
from specbuild.errors import SpecbuildError


def export(tokens_per_s: float, ttft_ns: float) -> dict:
    """The shape of AIPerf's profile_export_aiperf.json (the metrics this driver reads)."""
    latency = {"unit": "ms", "avg": 50.0, "p50": 40.0, "p90": 90.0, "p99": 120.0}
    return {
        "aiperf_version": "0.13.0",
        "request_count": {"unit": "requests", "avg": 8.0},
        "output_token_throughput": {"unit": "tokens/sec", "avg": tokens_per_s},
        "output_token_throughput_per_user": {"unit": "tokens/sec/user", "avg": tokens_per_s / 4},
        "request_throughput": {"unit": "requests/sec", "avg": 1.5},
        "input_sequence_length": {"unit": "tokens", "avg": 60.0},
        "output_sequence_length": {"unit": "tokens", "avg": 32.0},
        "time_to_first_token": {"unit": "ns", "avg": ttft_ns, "p50": ttft_ns, "p90": ttft_ns, "p99": ttft_ns},
        "inter_token_latency": {"unit": "ms", "avg": 9.0, "p50": 8.0, "p90": 11.0, "p99": 15.0},
        "request_latency": latency,
    }


def test_rows_read_aiperf_metrics_in_milliseconds_and_compare_with_the_baseline():
    no_drafts = {"drafts": 0, "draft_tokens": 0, "accepted": 0}
    rows = [
        summary_row("none", "none", 4, export(100.0, 2e6), no_drafts),
        summary_row("eagle3", "eagle3", 4, export(150.0, 3e6), {"drafts": 10, "draft_tokens": 40, "accepted": 15}),
    ]
    speedups(rows, "none")
    assert rows[0]["requests"] == 8 and rows[0]["errors"] == 0
    assert rows[0]["ttft_ms"]["p50"] == pytest.approx(2.0) and rows[1]["itl_ms"]["p99"] == 15.0
    assert rows[1]["vs_baseline"] == pytest.approx(1.5) and rows[0]["vs_baseline"] == pytest.approx(1.0)
    assert rows[1]["acceptance_length"] == pytest.approx(2.5) and rows[0]["acceptance_length"] is None
    table = markdown_table(rows, "none").splitlines()
    assert len(table) == 4 and "| eagle3 | eagle3 | 4 | 8 (0) | 150.0 | 1.50x |" in table[3]
    assert table[3].endswith("| 2.50 (10) |") and table[2].endswith("| - |")  # `none` never drafts


def test_spec_decode_counters_are_counted_over_the_run():
    drafts, accepted = SPEC_COUNTERS["drafts"], SPEC_COUNTERS["accepted"]
    counts = spec_decode_counts({drafts: 10.0, accepted: 15.0}, {drafts: 20.0, accepted: 30.0})
    assert counts == {"drafts": 10, "draft_tokens": 0, "accepted": 15}
    text = '# HELP x\nspecbuild:spec_decode_num_drafts_total 3.0\na_total{position="0"} 1.0\na_total{position="1"} 2\n'
    assert metric_sums(text) == {drafts: 3.0, "a_total": 3.0}


def test_the_aiperf_command_is_streaming_greedy_chat_with_the_engine_tokenizer(tmp_path):
    inputs = dataset_args("synthetic:64", 8, 32, tmp_path)
    command = aiperf_command("aiperf", "http://127.0.0.1:9", "none", Path("e/none"), 4, 8, 32, inputs, tmp_path)
    line = shell_line(command)
    assert line.startswith("HF_ENDPOINT=http://127.0.0.1:9 ")
    wanted = ["--endpoint-type chat", "--streaming", "--tokenizer e/none", "--extra-inputs temperature:0"]
    wanted += ["--concurrency 4", "--request-count 8", "--output-tokens-mean 32", "--synthetic-input-tokens-mean 64"]
    assert all(part in line for part in wanted)


def test_real_prompts_become_an_aiperf_single_turn_file(tmp_path):
    args = dataset_args("mtbench,humaneval", 5, 32, tmp_path)
    lines = [json.loads(line) for line in (tmp_path / "prompts.jsonl").read_text().splitlines()]
    assert args[:2] == ["--input-file", str(tmp_path / "prompts.jsonl")] and "single_turn" in args
    assert len(lines) == 5 and all(set(row) == {"text", "output_length"} for row in lines)
    assert lines[1]["text"].startswith("from typing import List") and lines[0]["output_length"] == 32
    with pytest.raises(SpecbuildError, match="synthetic:N"):
        dataset_args("synthetic:x", 5, 32, tmp_path)
    with pytest.raises(SpecbuildError, match="--prompts tasks: its prompts are whole conversations"):
        dataset_args("mtbench,tasks", 5, 32, tmp_path)


def test_options_and_engine_labels():
    settings = parse_args(["--engine-dir", "a/none", "--engine-dir", "b/none", "--concurrency", "1,4"])
    assert settings.concurrency == [1, 4] and settings.requests == 32 and settings.prompts == "mtbench"
    assert engine_labels(settings.engine_dirs) == ["a-none", "b-none"]
    assert engine_labels([Path("x/none"), Path("x/eagle3")]) == ["none", "eagle3"]
    with pytest.raises(SystemExit):
        parse_args(["--engine-dir", "a", "--concurrency", "0"])
