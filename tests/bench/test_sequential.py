"""Benchmark report arithmetic: speed-up over the baseline, η and speed relative to the fastest other row."""

import pytest

from specbuild.bench.sequential import _parts, add_relative_speed, render


def _rows():
    return {
        "none": {"tokens_per_s": 30.0, "tau": 1.0},
        "medusa": {"tokens_per_s": 33.0, "tau": 1.5},
        "eagle3": {"tokens_per_s": 39.6, "tau": 2.2},
    }


def test_speedups_are_relative_to_the_baseline_and_to_the_fastest_other_row():
    rows = _rows()
    peers = {"ORT GenAI int4": {"tokens_per_s": 36.0}}
    add_relative_speed(rows, "none", peers)
    assert rows["eagle3"]["speedup"] == pytest.approx(1.32)
    assert rows["eagle3"]["eta"] == pytest.approx(1.32 / 2.2)
    assert rows["eagle3"]["vs_fastest"] == pytest.approx(39.6 / 36.0)  # faster than every alternative
    assert rows["medusa"]["vs_fastest"] == pytest.approx(33.0 / 39.6) and rows["none"]["speedup"] == pytest.approx(1)
    peer = peers["ORT GenAI int4"]
    assert peer["vs_fastest"] == pytest.approx(36.0 / 39.6) and "speedup" not in peer


def test_without_baseline_the_speedups_are_absent():
    rows = _rows()
    add_relative_speed(rows, None)
    assert all(r["speedup"] is None and r["eta"] is None for r in rows.values())
    assert rows["eagle3"]["vs_fastest"] == pytest.approx(1.2)


def test_render_names_no_mode_in_its_columns():
    from rich.console import Console

    rows = _rows()
    add_relative_speed(rows, "none")
    for r in rows.values():
        r.update(decode_tokens_per_s=r["tokens_per_s"], ttft_ms=100.0, host_ms_per_step=0.5, host_share=0.01)
        r.update(prompts=1, matches_baseline=1)
    report = {
        "settings": {"num_prompts": 1, "max_new_tokens": 8},
        "baseline": "none",
        "results": {"humaneval": {"engines": rows}},
    }
    console = Console(record=True, width=200)
    render(report, console)
    text = console.export_text()
    assert "vs fastest other" in text and "1.20" in text and "1.32" in text
    header = next(line for line in text.splitlines() if "tok/s" in line)
    assert "medusa" not in header and "eagle" not in header
    rows["eagle3"].update(own_none="int4 none", matches_own_none=1)  # an int4 engine: its own none is the reference
    console = Console(record=True, width=240)
    render(report, console)
    assert "(own none 1/1)" in console.export_text()


def test_the_plot_shows_every_row_of_every_prompt_set(tmp_path):
    pytest.importorskip("matplotlib")
    from specbuild.bench.plot import rows_of, write_plot

    rows = _rows()
    add_relative_speed(rows, "none")
    peers = {"ORT GenAI int4": {"tokens_per_s": 36.0}, "ORT GenAI int4 n-gram": {"tokens_per_s": 41.0, "tau": 3.1}}
    report = {
        "settings": {"num_prompts": 2, "max_new_tokens": 8},
        "baseline": "none",
        "results": {name: {"engines": rows, "peers": peers} for name in ("humaneval", "summarize")},
    }
    assert [label for label, _, _ in rows_of(report["results"]["summarize"])] == [*rows, *peers]
    png = write_plot(report, tmp_path / "bench.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_sampled_bench_seeds_each_prompt_and_says_so(tmp_path, monkeypatch):
    """Prompt i of a sampled run is seeded with --seed + i in every engine and peer; the title says how it decoded;
    a bad sampling option is one line naming its flag."""
    from click.testing import CliRunner

    from specbuild.bench import decoding
    from specbuild.cli.main import cli
    from specbuild.runtime.engine import SamplingParams

    sampling = SamplingParams(temperature=0.7, top_p=0.9, seed=5)
    assert [decoding.for_request(sampling, i).seed for i in range(3)] == [5, 6, 7]
    assert decoding.for_request(None, 2) == SamplingParams() == decoding.for_request(SamplingParams(seed=9), 1)
    record = decoding.to_dict(sampling)
    assert decoding.describe(record) == "sampled (T 0.7, top-p 0.9, seed 5)" and decoding.describe(None) == "greedy"
    report = {
        "settings": {"num_prompts": 1, "max_new_tokens": 8, "sampling": record},
        "baseline": None,
        "results": {"mtbench": {"engines": {}, "peers": {}}},
    }
    from rich.console import Console

    console = Console(record=True, width=240)
    render(report, console)
    assert "1 prompts, sampled (T 0.7, top-p 0.9, seed 5)" in console.export_text()
    res = CliRunner().invoke(cli, ["bench", "--engine-dir", str(tmp_path), "--temperature", "0.7", "--top-p", "2"])
    assert res.exit_code == 1 and res.output.strip() == "error: --top-p must be a number in (0, 1] (1 = off), got 2.0"


def test_traffic_sets_are_reported_whole_and_by_halves():
    assert _parts("mtbench", 24) == [("", slice(None))]
    parts = _parts("tasks", 25)
    assert [name for name, _ in parts] == ["", " (requests 1-12)", " (requests 13-25)"]
    requests = list(range(25))
    assert [requests[cut] for _, cut in parts[1:]] == [requests[:12], requests[12:]]
    assert _parts("tasks", 1) == [("", slice(None))]


def test_each_prompt_set_starts_from_nothing_learnt_and_its_passes_follow_each_other(monkeypatch):
    """What a drafter learnt from one set's responses (suffix's pool, recycle's table) never drafts another set's:
    the engines forget the traffic before each set, and a set's later passes draft from its earlier ones."""
    from types import SimpleNamespace

    from specbuild.bench import sequential

    events = []
    engine = SimpleNamespace(
        path="e", manifest={"speculative_mode": "suffix", "dtype": "float32"}, max_seq_len=64, lossless=True,
        exactness=SimpleNamespace(to_dict=dict), codec=SimpleNamespace(encode=lambda text: [1]),
        eos_ids=set(), forget_traffic=lambda: events.append("forget"),
    )  # fmt: skip
    monkeypatch.setattr(sequential, "load_engines", lambda *args: ([engine], ["suffix"]))
    monkeypatch.setattr(sequential, "load_prompt_set", lambda name, count: [name] * count)
    monkeypatch.setattr(sequential, "prompt_ids", lambda codec, name, text: [2])
    monkeypatch.setattr(sequential, "_rows", lambda *args: {})
    monkeypatch.setattr(sequential, "timed_generate", lambda eng, ids, n, sampling=None: events.append(ids[0]))
    report = sequential.run_benchmark(["e"], ["humaneval", "mtbench"], num_prompts=2, passes=2, log=lambda line: None)
    generate = 2  # every prompt's generation (the warm-up's is 1)
    assert events == [1, "forget", *[generate] * 4, "forget", *[generate] * 4]
    assert list(report["results"]) == ["humaneval", "humaneval, pass 2", "mtbench", "mtbench, pass 2"]
