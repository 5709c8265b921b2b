"""Suffix decoding's pool behind the server: with API keys each key's requests learn from that key's responses only
(another key's acceptance is untouched), `--shared-draft-pool` shares one pool, `--draft-pool DIR` keeps it across
restarts (a file per key, named by a hash of the key, never the key), and every answer is the `none` engine's text."""

from __future__ import annotations

import pytest

from tests.helpers import ORT_ONLY, quiet
from tests.serve.conftest import MAX_SEQ_LEN, ServerProcess
from tests.tiers import full

pytestmark = pytest.mark.xdist_group("serve")

KEY_A, KEY_B = "client-a-key-123", "client-b-key-456"
PROMPT = "the cat sat on"


@pytest.fixture(scope="module")
def suffix_engine(serve_engines):
    from specbuild.builder.build import BuildOptions, build_engine

    root = serve_engines["none"].parent
    options = BuildOptions(backends=ORT_ONLY, max_seq_len=MAX_SEQ_LEN, speculative_mode="suffix", num_draft_tokens=6)
    return build_engine(root / "ckpt", root / "suffix", options, log=quiet)


def _ask(server, key: str, want: str) -> float:
    """The text of PROMPT for `key` (checked against `want`); its mean accepted tokens per step."""
    server.key = key
    got = server.client().completions.create(model=server.model, prompt=PROMPT, max_tokens=40, temperature=0)
    assert got.choices[0].text == want
    return got.usage.model_extra["mean_accepted_tokens_per_step"]


def test_each_key_learns_from_its_own_responses_and_the_pool_survives_a_restart(
    suffix_engine, reference_engine, tmp_path
):
    want = reference_engine.generate(prompt=PROMPT, max_new_tokens=40).text
    keys = ("--api-key", KEY_A, "--api-key", KEY_B, "--draft-pool", str(tmp_path / "pool"))
    server = ServerProcess(suffix_engine, tmp_path / "log", *keys, key=KEY_A).wait_ready()
    try:
        first = _ask(server, KEY_A, want)
        again = _ask(server, KEY_A, want)
        other = _ask(server, KEY_B, want)
        held, bound = server.metric("specbuild:draft_memory_bytes"), server.metric("specbuild:draft_memory_bound_bytes")
    finally:
        server.close()
    assert 0 < held < bound  # two keys' pools, far from their bound
    assert again > first + 0.5  # A's answer is in A's pool
    assert other == pytest.approx(first)  # ... and not in B's
    files = sorted((tmp_path / "pool").glob("suffix-*.jsonl"))
    assert sorted(len(f.read_text().splitlines()) for f in files) == [1, 2]
    assert not any(key in f.name for f in files for key in (KEY_A, KEY_B))
    server = ServerProcess(suffix_engine, tmp_path / "log2", *keys, key=KEY_B).wait_ready()
    try:
        assert _ask(server, KEY_B, want) == pytest.approx(again)  # B's pool came back from its file
    finally:
        server.close()


@full("a third server: the fast tier checks the per-key pools, which a shared pool only relaxes")
def test_a_shared_pool_lets_one_keys_responses_draft_for_another(suffix_engine, reference_engine, tmp_path):
    want = reference_engine.generate(prompt=PROMPT, max_new_tokens=40).text
    server = ServerProcess(
        suffix_engine, tmp_path / "log", "--api-key", KEY_A, "--api-key", KEY_B, "--shared-draft-pool", key=KEY_A
    ).wait_ready()
    try:
        first = _ask(server, KEY_A, want)
        assert _ask(server, KEY_B, want) > first + 0.5
    finally:
        server.close()
