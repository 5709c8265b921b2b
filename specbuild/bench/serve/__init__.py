"""`scripts/bench-serve.sh`: `specbuild serve` under load, measured the way the field measures it, with AIPerf.

For each engine directory (outer loop) a server starts on a free local port; AIPerf (its own virtual environment,
offline, the engine directory's tokenizer) drives its chat endpoint, streaming and greedy, at each
concurrency (inner loop); the server then stops with SIGINT. TTFT, inter-token latency, output tokens/s and request
latency percentiles from every run's profile_export_aiperf.json become one summary (markdown, JSON) and a plot.
`python -m specbuild.bench.serve --help` lists the options; the script installs AIPerf and passes it along.
"""
