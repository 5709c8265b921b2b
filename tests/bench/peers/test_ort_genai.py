"""The ONNX Runtime GenAI peer (bench/peers/ort_genai.py) on its model builder's graph of a tiny model: greedy and
its n-gram give transformers' greedy ids, a seed repeats a sampled output, and its static batch under load gives the
greedy ids one by one."""

import sys

import pytest

from specbuild.bench.load import closed_loop
from specbuild.errors import SpecbuildError
from tests.bench.test_load import MAX_NEW_TOKENS, PROMPTS
from tests.tiers import full


@full("ONNX Runtime GenAI's model builder on a tiny model")
def test_ort_genai_peer_rows_are_greedy_and_its_ngram_is_lossless(tiny_hf_models, tmp_path):
    """The ONNX Runtime GenAI rows of `specbuild bench` time what a CPU user would run instead: its model builder's
    graph of the same checkpoint, greedy and with its n-gram speculation, both giving transformers' greedy ids."""
    pytest.importorskip("onnxruntime_genai")
    import shutil
    import subprocess
    import sys

    import torch
    from transformers import AutoModelForCausalLM

    from specbuild.bench.peers.ort_genai import OrtGenAITimer
    from specbuild.errors import SpecbuildError
    from tests.helpers import hf_greedy, write_char_tokenizer

    hf = shutil.copytree(tiny_hf_models["llama_gqa_llama3rope"], tmp_path / "hf")
    write_char_tokenizer(hf)  # the model builder copies a tokenizer into its output
    builder = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", hf, "-o", tmp_path / "genai"]
    subprocess.run([*map(str, builder), "-p", "fp32", "-e", "cpu"], check=True, capture_output=True)
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    for ids in ([1, 5, 9, 3, 7, 5, 9, 3], [2, 40, 41]):
        want = hf_greedy(model, ids, 24)
        for ngram in (False, True):
            sample = OrtGenAITimer(tmp_path / "genai", threads=1, ngram=ngram).sample(ids, 24)
            assert sample.output_ids == want, ngram
            assert sample.total_s > 0 and sample.ttft_s <= sample.total_s
            if ngram:  # a call emits at most its drafts + 1 (its plain fallback steps count; a re-anchor emits none)
                assert sample.accepted == 23 <= (1 + OrtGenAITimer.NGRAM["max_draft_tokens"]) * sample.steps
    from specbuild.runtime.engine import SamplingParams

    timer = OrtGenAITimer(tmp_path / "genai", threads=1)  # sampled (bench --temperature): its seed repeats it
    runs = [timer.sample(ids, 24, SamplingParams(temperature=1.5, top_p=0.95, seed=s)).output_ids for s in (3, 3, 4)]
    assert runs[0] == runs[1] != runs[2] and runs[0] != want
    with pytest.raises(SpecbuildError, match="not an ONNX Runtime GenAI model directory"):
        OrtGenAITimer(hf, threads=1)


@full("ONNX Runtime GenAI's model builder on a tiny model")
def test_ort_genai_static_batch_gives_greedy_ids_through_the_closed_loop(tiny_hf_models, tmp_path):
    """The static-batch reference row: prompts of different lengths batched (padded) give transformers' greedy
    ids one by one; a request submitted while a batch runs waits for the next one."""
    pytest.importorskip("onnxruntime_genai")
    import shutil
    import subprocess

    import torch
    from transformers import AutoModelForCausalLM

    from specbuild.bench.peers.ort_genai import OrtGenAIBatch
    from tests.helpers import hf_greedy, write_char_tokenizer

    hf = shutil.copytree(tiny_hf_models["llama_gqa_llama3rope"], tmp_path / "hf")
    write_char_tokenizer(hf)
    builder = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", hf, "-o", tmp_path / "genai"]
    subprocess.run([*map(str, builder), "-p", "fp32", "-e", "cpu"], check=True, capture_output=True)
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    peer = OrtGenAIBatch(tmp_path / "genai", threads=1, max_new_tokens=MAX_NEW_TOKENS)
    assert peer.label == "ORT GenAI static batch genai"
    run = closed_loop(peer, PROMPTS, 3)
    assert [r.output_ids for r in run.done] == [hf_greedy(model, ids, MAX_NEW_TOKENS) for ids in PROMPTS]
    assert run.most_in_flight == 3 and all(0 <= r.ttft_s <= r.last_token_s <= r.latency_s for r in run.done)
    # static: 7 prompts at 3 in flight are three batches of MAX_NEW_TOKENS steps (EOS aside: random ids)
    assert run.steps == 3 * MAX_NEW_TOKENS
    with pytest.raises(SpecbuildError, match="not an ONNX Runtime GenAI model directory"):
        OrtGenAIBatch(hf, threads=1, max_new_tokens=4)
