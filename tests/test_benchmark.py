"""Benchmark report arithmetic: speed-up over `none`, η and speed relative to Medusa from one run's rows."""

import pytest

from specbuild.benchmark import add_relative_speed, render


def _rows():
    return {
        "none": {"tokens_per_s": 30.0, "tau": 1.0},
        "medusa": {"tokens_per_s": 33.0, "tau": 1.5},
        "eagle3": {"tokens_per_s": 39.6, "tau": 2.2},
    }


def test_speedups_are_relative_to_none_and_medusa():
    rows = _rows()
    add_relative_speed(rows, "none", "medusa")
    assert rows["eagle3"]["speedup"] == pytest.approx(1.32)
    assert rows["eagle3"]["eta"] == pytest.approx(1.32 / 2.2)
    assert rows["eagle3"]["vs_medusa"] == pytest.approx(1.2)
    assert rows["medusa"]["vs_medusa"] == pytest.approx(1.0) and rows["none"]["speedup"] == pytest.approx(1.0)


def test_without_baseline_or_medusa_the_ratios_are_absent():
    rows = _rows()
    add_relative_speed(rows, None, None)
    assert all(r["speedup"] is None and r["eta"] is None and r["vs_medusa"] is None for r in rows.values())


def test_render_shows_the_medusa_column():
    from rich.console import Console

    rows = _rows()
    add_relative_speed(rows, "none", "medusa")
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
    assert "vs medusa" in text and "1.20" in text and "1.32" in text
