"""bench/scale.py: each command measured in its own process (wall time, peak RSS, exit status), and the report's
table says what was refused."""

import sys

from specbuild.bench import scale


def test_a_command_is_measured_in_its_own_process():
    grow = "b = bytearray(300 * 1024 * 1024); b[::4096] = b'x' * len(b[::4096]); print('done')"
    result = scale.measured([sys.executable, "-c", grow], log=lambda line: None)
    assert result["rc"] == 0 and result["last_line"] == "done"
    assert result["peak_rss_gb"] > 0.3  # this child's, not the test process's
    failed = scale.measured([sys.executable, "-c", "import sys; print('error: no'); sys.exit(1)"], log=lambda _: None)
    assert failed["rc"] == 1 and failed["last_line"] == "error: no"


def test_a_command_with_a_child_process_is_measured_whole():
    """Both processes' memory at once: a build checks its graph in a child while it writes
    (builder/export/child_job.py)."""
    child = "b = bytearray(300 * 1024 * 1024); b[::4096] = b'x' * len(b[::4096]); import time; time.sleep(1.5)"
    parent = (f"import subprocess, sys; b = bytearray(300 * 1024 * 1024); b[::4096] = b'x' * len(b[::4096]); "
              f"subprocess.run([sys.executable, '-c', {child!r}], check=True); print('done')")  # fmt: skip
    result = scale.measured([sys.executable, "-c", parent], log=lambda line: None)
    assert result["rc"] == 0 and result["peak_rss_gb"] > 0.6  # one process alone holds 0.33 GB


def test_the_table_shows_refusals_and_peers():
    report = {
        "model": "m",
        "cpu": "cpu",
        "convert": {"seconds": 1.0, "peak_rss_gb": 0.5},
        "builds": {
            "fp32": {
                "seconds": 2.0,
                "peak_rss_gb": 1.0,
                "rc": 1,
                "last_line": "error: --weights fp32: too big",
                "engine_gb": 0.0,
            },  # fmt: skip
            "int4": {"seconds": 3.0, "peak_rss_gb": 0.7, "rc": 0, "last_line": "ok", "engine_gb": 0.2},
        },
        "genai_builds": {"int4": {"seconds": 1.5, "peak_rss_gb": 0.9, "rc": 0, "engine_gb": 0.25}},
        "speed": {
            "int4": {
                "sets": {"humaneval": {"none": 10.0, "ORT GenAI g": 9.0}},
                "cost_curve": [{"rows": 1, "ms": 5.0}, {"rows": 2, "ms": 6.0}],
            }
        },  # fmt: skip
    }
    table = scale.render(report)
    assert "| build fp32 | refused (error: --weights fp32: too big) | 1.0 |" in table
    assert "| build int4 | 3.0 | 0.7 | 1.5 | 0.9 | 0.2 / 0.25 |" in table
    assert "none 10.00, ORT GenAI g 9.00" in table and "1: 5.0, 2: 6.0" in table
