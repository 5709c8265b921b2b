"""A soak of `specbuild serve`: a real server process driven for a fixed time at twice its KV slots in flight with a
mix of greedy, seeded-sampling, stop-string, streamed, disconnecting and bad requests, checked as it goes.

It fails (exit 1, the reasons in the report) when: a greedy text differs from the same request sent alone before the
load; a seeded request's text differs from its first answer; a stop string is not honoured; anything answers 5xx
(status or stream error event); a bad request is not refused with a 4xx JSON error; the server's RSS, less the KV
cache's written pages (/metrics kv_cache_bytes: they grow with the longest sequence each slot has held, up to their
bound), rises after the warm-up (the first half of the load) above its high-water mark of the warm-up by more than
RSS_SLACK (allocators keep what the largest calls took, a leak keeps growing: see check_rss); the KV cache or what
the drafters learnt from traffic (suffix decoding's pools) holds more than its bound at any reading of /metrics;
/metrics does not add up (success + cancelled + errors = requests sent); or the server is not healthy at the end.
`scripts/soak-serve.sh` runs it; tests/serve/test_soak.py runs 60 seconds of it.

    python -m specbuild.serve.soak --engine-dir ENGINE [--duration 600] [--report soak.md]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from specbuild.ports import free_port

PROMPTS = [
    "def fibonacci(n):",
    "Write a haiku about caches.",
    "The capital of France is",
    "import numpy as np\n\ndef softmax(x):",
    "List three prime numbers:",
    "Once upon a time",
    "SELECT name FROM users WHERE",
    "abcabcabcabc",
]
BAD_REQUESTS = [  # (body bytes, expected status)
    (b'{"model": "MODEL", "messages": [', 400),
    (b"[" * 5000 + b"]" * 5000, 400),
    (b'{"model": "MODEL", "prompt": "\\ud800 lone", "max_tokens": 4}', 400),
    (b'{"model": "MODEL", "prompt": "x", "max_tokens": -1}', 400),
    (b'{"model": "no-such-model", "prompt": "x"}', 404),
    (b'{"model": "MODEL", "prompt": "x", "temperature": NaN, "max_tokens": 2}', 400),
]
KINDS = {"greedy": 4, "greedy_stream": 3, "seeded": 2, "stop": 2, "disconnect": 1, "bad": 1}
RSS_SLACK = 0.03  # relative RSS growth allowed after the warm-up (allocator noise), at least RSS_SLACK_MB
RSS_SLACK_MB = 24
LEARNT_EVERY_S = 30  # how often the drafters' learnt memory is read from /metrics


@dataclasses.dataclass
class Tally:
    sent: int = 0
    by_kind: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    statuses: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    tokens: int = 0
    failures: list = dataclasses.field(default_factory=list)

    def fail(self, message: str) -> None:
        if len(self.failures) < 50:
            self.failures.append(message)


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


class Soak:
    def __init__(self, model: str, slots: int, seed: int):
        self.model, self.slots = model, slots
        self.rng = random.Random(seed)
        self.tally = Tally()
        self.solo: dict[tuple, str] = {}  # (prompt, max_tokens, chat) -> the text sent alone
        self.seeded: dict[tuple, str] = {}

    def body(self, prompt: str, max_tokens: int, chat: bool, **fields) -> tuple[str, dict]:
        body = {"model": self.model, "max_tokens": max_tokens, "temperature": 0, **fields}
        if chat:
            return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}
        return "/v1/completions", {**body, "prompt": prompt}

    @staticmethod
    def text(reply: dict, chat: bool) -> str:
        choice = reply["choices"][0]
        return choice["message"]["content"] if chat else choice["text"]

    async def post(self, client, path: str, body) -> tuple[int, dict]:
        self.tally.sent += 1
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        response = await client.post(path, content=content, headers={"content-type": "application/json"})
        self.tally.statuses[response.status_code] += 1
        if response.status_code >= 500:
            self.tally.fail(f"{path}: {response.status_code} {response.text[:200]}")
        return response.status_code, response.json()

    async def reference(self, client) -> None:
        """Every greedy request the load will send, sent alone first."""
        for prompt in PROMPTS:
            for chat in (False, True):
                for max_tokens in (8, 32):
                    path, body = self.body(prompt, max_tokens, chat)
                    status, reply = await self.post(client, path, body)
                    if status != 200:
                        raise RuntimeError(f"the solo request {body} got {status}: {reply}")
                    self.solo[(prompt, max_tokens, chat)] = self.text(reply, chat)
                    self.tally.tokens += reply["usage"]["completion_tokens"]

    async def one(self, client) -> None:
        kind = self.rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
        self.tally.by_kind[kind] += 1
        prompt, chat = self.rng.choice(PROMPTS), self.rng.random() < 0.5
        max_tokens = self.rng.choice((8, 32))
        want = self.solo[(prompt, max_tokens, chat)]
        if kind == "stop" and len(want) < 4:
            kind = "greedy"  # too short to cut
        if kind == "greedy":
            path, body = self.body(prompt, max_tokens, chat)
            status, reply = await self.post(client, path, body)
            if status == 200:
                self._expect(self.text(reply, chat), want, body)
                self.tally.tokens += reply["usage"]["completion_tokens"]
        elif kind == "greedy_stream":
            path, body = self.body(prompt, max_tokens, chat, stream=True)
            text = await self.stream(client, path, body, chat)
            if text is not None:
                self._expect(text, want, body)
        elif kind == "seeded":
            seed = self.rng.randrange(4)
            path, body = self.body(prompt, max_tokens, chat, temperature=0.8, top_p=0.95, seed=seed)
            status, reply = await self.post(client, path, body)
            if status == 200:
                first = self.seeded.setdefault((prompt, max_tokens, chat, seed), self.text(reply, chat))
                self._expect(self.text(reply, chat), first, body)
                self.tally.tokens += reply["usage"]["completion_tokens"]
        elif kind == "stop":
            cut = len(want) // 2
            stop = want[cut : cut + 2]
            path, body = self.body(prompt, max_tokens, chat, stop=[stop])
            status, reply = await self.post(client, path, body)
            if status == 200:
                self._expect(self.text(reply, chat), want[: want.find(stop)], body)
        elif kind == "disconnect":
            path, body = self.body(prompt, 32, chat, stream=True)
            await self.stream(client, path, body, chat, leave_after=2)
        else:
            raw, expected = self.rng.choice(BAD_REQUESTS)
            status, reply = await self.post(client, "/v1/completions", raw.replace(b"MODEL", self.model.encode()))
            if status != expected or reply.get("error", {}).get("code") != status:
                self.tally.fail(f"bad request {raw[:60]!r}: {status} {reply}, expected {expected}")

    def _expect(self, got: str, want: str, body: dict) -> None:
        if got != want:
            self.tally.fail(f"{json.dumps(body)[:160]}: got {got!r}, alone it gave {want!r}")

    async def stream(self, client, path: str, body: dict, chat: bool, leave_after: int | None = None) -> str | None:
        """The streamed text (None when refused, or when the client leaves after `leave_after` events)."""
        self.tally.sent += 1
        parts, events = [], 0
        async with client.stream("POST", path, json=body) as response:
            self.tally.statuses[response.status_code] += 1
            if response.status_code != 200:
                if response.status_code >= 500:
                    self.tally.fail(f"{path} stream: {response.status_code}")
                await response.aread()
                return None
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[len("data: ") :])
                if "error" in event:
                    self.tally.fail(f"stream error event: {event['error']}")
                    return None
                events += 1
                if leave_after is not None and events >= leave_after:
                    return None  # the context manager closes the connection: the server cancels the request
                choice = event["choices"][0] if event["choices"] else None
                if choice is not None:
                    parts.append((choice["delta"].get("content") if chat else choice["text"]) or "")
        return "".join(parts)

    async def worker(self, client, deadline: float) -> None:
        while time.monotonic() < deadline:
            try:
                await self.one(client)
            except Exception as exc:  # noqa: BLE001 - a transport failure is a finding, not a crash of the soak
                self.tally.fail(f"{type(exc).__name__}: {exc}")


async def drive(url: str, model: str, slots: int, duration: float, seed: int, sample_rss) -> tuple[Soak, list, list]:
    """The load; every 2 s the RSS with the KV cache's bytes and bound (/metrics) read beside it: rss entries are
    (seconds, RSS MB, KV MB, KV bound MB); the drafters' learnt memory every LEARNT_EVERY_S."""
    import httpx

    soak = Soak(model, slots, seed)
    limits = httpx.Limits(max_connections=4 * slots + 8)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        await soak.reference(client)
        rss: list[tuple[float, float, float, float]] = []
        learnt: list[tuple[float, float, float]] = []
        start = time.monotonic()

        async def sample(last: bool):
            text = (await client.get("/metrics")).text
            t = time.monotonic() - start
            rss.append((t, sample_rss(), *(b / 2**20 for b in kv_memory(text))))
            if last or not learnt or t - learnt[-1][0] >= LEARNT_EVERY_S:
                learnt.append((t, *learnt_memory(text)))

        async def sampler():
            while True:
                await sample(False)
                await asyncio.sleep(2)

        sampling = asyncio.ensure_future(sampler())
        deadline = start + duration
        await asyncio.gather(*(soak.worker(client, deadline) for _ in range(2 * slots)))
        sampling.cancel()
        await sample(True)
    return soak, rss, learnt


def kv_memory(metrics_text: str) -> tuple[float, float]:
    """/metrics' bytes of the KV cache held, and their bound."""
    return (
        _metric(metrics_text, "specbuild:kv_cache_bytes"),
        _metric(metrics_text, "specbuild:kv_cache_bound_bytes"),
    )


def learnt_memory(metrics_text: str) -> tuple[float, float]:
    """/metrics' bytes of what the drafters learnt from traffic, and their bound."""
    return (
        _metric(metrics_text, "specbuild:draft_memory_bytes"),
        _metric(metrics_text, "specbuild:draft_memory_bound_bytes"),
    )


def check_learnt(learnt: list) -> tuple[str | None, str | None]:
    """The report's line on the drafters' learnt memory (None: the mode learns nothing), and a failure message
    when it was ever over its bound."""
    if not learnt or not any(bound for _, _, bound in learnt):
        return None, None
    most = max(learnt, key=lambda sample: sample[1])
    marks = {}
    for t, held, _ in learnt:
        marks.setdefault(int(t // 60), held)
    by_minute = ", ".join(f"{minute}: {held / 1e6:.1f}" for minute, held in marks.items())
    line = (
        f"- drafting state learnt from traffic (/metrics draft_memory_bytes): at most {most[1] / 1e6:.1f} MB "
        f"(bound {most[2] / 1e6:.1f} MB), by minute (MB): {by_minute}"
    )
    over = [(t, held, bound) for t, held, bound in learnt if held > bound]
    if over:
        t, held, bound = over[0]
        failure = f"the drafters' learnt memory was {held / 1e6:.1f} MB at {t:.0f} s, over its bound {bound / 1e6:.1f}"
        return line, failure
    return line, None


def _metric(text: str, name: str) -> float:
    """The sum of a sample's values (all labels) in a Prometheus exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    families = text_string_to_metric_families(text)
    return sum(sample.value for family in families for sample in family.samples if sample.name == name)


def settle(url: str, timeout: float = 30) -> str:
    """/metrics once nothing runs or waits (the cancellations of the last disconnects have landed)."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(url + "/metrics", timeout=10).text
        idle = _metric(text, "specbuild:num_requests_running") + _metric(text, "specbuild:num_requests_waiting") == 0
        if idle or time.monotonic() > deadline:
            return text
        time.sleep(0.2)


def check_rss(rss: list, warmup_s: float) -> tuple[float, float, str | None]:
    """RSS less the KV cache's bytes (rss entries: seconds, RSS MB, KV MB, KV bound MB): its high-water mark in the
    warm-up and the most after it; a failure message when the latter is higher beyond the slack, or the KV cache held
    more than its bound.

    The warm-up's high, not its last reading, is the base: ONNX Runtime's arena and the C allocator keep the memory
    of the largest calls they served (their shapes follow the batch and the sequences' lengths, which a soak's mix
    reaches within minutes), and give none of it back; a leak keeps rising, so it sets new highs after the warm-up."""
    other = [(t, mb - kv) for t, mb, kv, _ in rss]
    before = [mb for t, mb in other if t <= warmup_s] or [other[0][1]]
    after = [mb for t, mb in other if t > warmup_s] or [other[-1][1]]
    base, peak = max(before), max(after)
    allowed = max(base * RSS_SLACK, RSS_SLACK_MB)
    over = [(t, kv, bound) for t, _, kv, bound in rss if kv > bound]
    if over:
        t, kv, bound = over[0]
        return base, peak, f"the KV cache held {kv:.0f} MB at {t:.0f} s, over its bound {bound:.0f}"
    if peak - base > allowed:
        grew = f"RSS less the KV cache grew from {base:.0f} MB to {peak:.0f} MB after the warm-up"
        return base, peak, f"{grew} (allowed {allowed:.0f})"
    return base, peak, None


def _by_minute(rss: list, value=lambda sample: sample[1]) -> str:
    marks = {}
    for sample in rss:
        marks.setdefault(int(sample[0] // 60), value(sample))  # the first sample of each minute
    marks["end"] = value(rss[-1])
    return ", ".join(f"{minute}: {mb:.0f}" for minute, mb in marks.items())


def report(
    soak: Soak, rss: list, metrics_text: str, args, warmup_s: float, healthy: bool, learnt: list = ()
) -> tuple[str, bool]:
    tally = soak.tally
    base, peak, rss_failure = check_rss(rss, warmup_s)
    if rss_failure:
        tally.fail(rss_failure)
    learnt_line, learnt_failure = check_learnt(list(learnt))
    if learnt_failure:
        tally.fail(learnt_failure)
    counted = sum(
        _metric(metrics_text, f"specbuild:{name}")
        for name in ("request_success_total", "request_cancelled_total", "request_errors_total")
    )
    if counted != tally.sent:
        tally.fail(f"/metrics counts {counted:.0f} requests (success + cancelled + errors), {tally.sent} were sent")
    if not healthy:
        tally.fail("/health was not 200 at the end")
    errors = {s: n for s, n in sorted(tally.statuses.items()) if s >= 400}
    lines = [
        f"# Soak of specbuild serve: {'PASS' if not tally.failures else 'FAIL'}",
        "",
        f"- engine: {args.engine_dir}; {soak.slots} slots, {2 * soak.slots} requests in flight; "
        f"{args.duration:g} s of load (after {len(soak.solo)} solo reference requests); seed {args.seed}",
        f"- requests sent: {tally.sent} ({', '.join(f'{k} {n}' for k, n in sorted(tally.by_kind.items()))})",
        f"- statuses: {dict(sorted(tally.statuses.items()))}; errors by status: {errors or 'none'}",
        f"- completion tokens (non-streamed answers): {tally.tokens}",
        f"- server RSS: {rss[0][1]:.0f} MB at the start of the load, {rss[-1][1]:.0f} MB at the end; less the KV "
        f"cache: at most {base:.0f} MB in the warm-up ({warmup_s:g} s), at most {peak:.0f} MB after",
        f"- server RSS by minute of load (MB): {_by_minute(rss)}",
        f"- KV cache held (/metrics kv_cache_bytes) by minute (MB): {_by_minute(rss, lambda s: s[2])} "
        f"(bound {rss[-1][3]:.0f})",
        f"- server RSS less the KV cache by minute (MB): {_by_minute(rss, lambda s: s[1] - s[2])}",
        *([learnt_line] if learnt_line else []),
        f"- /metrics: success + cancelled + errors = {counted:.0f} (sent {tally.sent})",
        f"- failures: {len(tally.failures)}",
        *[f"  - {failure}" for failure in tally.failures],
    ]
    return "\n".join(lines) + "\n", not tally.failures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine-dir", required=True, type=Path)
    parser.add_argument("--duration", type=float, default=600, help="Seconds of load (default 600).")
    parser.add_argument(
        "--warmup", type=float, help="Seconds of load after which RSS sets no new high (default: half the duration)."
    )
    parser.add_argument("--max-batch-size", type=int, help="KV slots of the server (default: the engine's).")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--report", type=Path, help="Write the report here too (markdown).")
    args = parser.parse_args(argv)
    import httpx

    from specbuild.runtime.manifest import load_manifest

    slots = args.max_batch_size or load_manifest(args.engine_dir)["limits"]["max_batch_size"]
    warmup_s = args.warmup if args.warmup is not None else args.duration / 2
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "specbuild.cli.main", "serve", "--engine-dir", str(args.engine_dir)]
    command += ["--port", str(port), "--threads", str(args.threads), "--max-batch-size", str(slots)]
    log_path = Path(os.environ.get("SPECBUILD_SOAK_LOG", "soak-server.log"))
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while True:
            if server.poll() is not None or time.monotonic() > deadline:
                print(f"error: the server did not start (see {log_path})", file=sys.stderr)
                return 1
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        soak, rss, learnt = asyncio.run(drive(url, model, slots, args.duration, args.seed, lambda: _rss_mb(server.pid)))
        metrics_text = settle(url)
        healthy = httpx.get(url + "/health", timeout=10).status_code == 200
    finally:
        server.terminate()
        server.wait(30)
    text, passed = report(soak, rss, metrics_text, args, warmup_s, healthy, learnt)
    if server.returncode != 0:
        text += f"- the server exited {server.returncode} on SIGTERM\n"
        passed = False
    print(text)
    if args.report:
        args.report.write_text(text)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
