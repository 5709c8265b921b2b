"""The transformers peer (bench/peers/transformers.py): generate, greedy and with prompt lookup, gives transformers'
greedy ids, assisted generation takes a draft that borrows the target's embedding, sampling follows the request's
seed; the static batch under load gives the greedy ids one by one and samples with its seed."""

import json

import pytest

from specbuild.bench.load import closed_loop
from tests.bench.test_load import MAX_NEW_TOKENS, PROMPTS


def test_transformers_rows_greedy_and_prompt_lookup_give_its_greedy_ids(tiny_hf_models):
    """`--hf-model-dir` adds transformers' greedy generate and its prompt lookup decoding; both are exact."""
    from specbuild.bench.peers.transformers import HFTimer
    from tests.helpers import hf_greedy

    model = HFTimer.load(tiny_hf_models["llama_gqa_llama3rope"], threads=1)
    ids = [1, 5, 9, 3, 7, 5, 9, 3]
    want = hf_greedy(model, ids, 20)
    for lookup in (None, 10):
        timer = HFTimer(model, eos_ids=set(), prompt_lookup=lookup)
        sample = timer.sample(ids, 20)
        assert sample.output_ids[: len(want)] == want and timer.ngram == bool(lookup)
    assert "prompt lookup 10" in timer.label


def test_transformers_assisted_generation_with_a_draft_that_borrows_the_embedding(tmp_path, tiny_hf_models):
    """`--hf-assistant-dir`: transformers' assisted generation with a draft model, here one saved without its
    embedding (config.json says it takes the target's, as the draft shipped for SmolLM2 does); exact greedy ids."""
    import torch
    from safetensors.torch import load_file, save_file

    from specbuild.bench.peers.transformers import HFTimer
    from specbuild.errors import SpecbuildError
    from tests.helpers import hf_greedy
    from tests.shapes import tiny_hf_model

    model = HFTimer.load(tiny_hf_models["llama_tied_linear"], threads=1)
    draft = tiny_hf_model("llama_tied_linear", seed=5, num_hidden_layers=1)
    draft.save_pretrained(tmp_path / "draft")
    tensors = load_file(tmp_path / "draft" / "model.safetensors")
    del tensors["model.embed_tokens.weight"]
    save_file(tensors, tmp_path / "draft" / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    config["specbuild"] = {"embeddings": "target"}
    (tmp_path / "draft" / "config.json").write_text(json.dumps(config))
    assistant = HFTimer.load_assistant(tmp_path / "draft", model)
    embed = model.get_input_embeddings().weight
    assert torch.equal(assistant.get_input_embeddings().weight, embed)
    assert torch.equal(assistant.get_output_embeddings().weight, embed)  # tied, as in the target
    ids = [1, 5, 9, 3, 7, 5, 9, 3]
    timer = HFTimer(model, eos_ids=set(), assistant=assistant, assistant_name="draft")
    assert timer.sample(ids, 20).output_ids[:20] == hf_greedy(model, ids, 20)[:20]
    assert timer.label == "HF transformers assisted generation (draft)"
    with pytest.raises(SpecbuildError, match="--hf-assistant-dir does not exist"):
        HFTimer.load_assistant(tmp_path / "nowhere", model)


def test_transformers_rows_sample_with_the_request_seed(tiny_hf_models):
    """`bench --temperature`: transformers' generate samples with the request's settings, seeded by its seed."""
    from specbuild.bench.peers.transformers import HFTimer
    from specbuild.runtime.engine import SamplingParams
    from tests.helpers import hf_greedy

    model = HFTimer.load(tiny_hf_models["llama_gqa_llama3rope"], threads=1)
    timer, ids = HFTimer(model, eos_ids=set()), [1, 5, 9, 3, 7]

    def sampled(seed):
        return timer.sample(ids, 12, SamplingParams(temperature=1.5, top_k=30, top_p=0.95, seed=seed)).output_ids

    assert sampled(4) == sampled(4) != sampled(5)
    assert sampled(4) != hf_greedy(model, ids, 12)


def test_transformers_static_batch_gives_greedy_ids_through_the_closed_loop(tiny_hf_models):
    """The transformers row under load: prompts of different lengths, left-padded in one batch, give transformers'
    own greedy ids one by one; a request submitted while a batch runs waits for the next one."""
    import torch
    from transformers import AutoModelForCausalLM

    from specbuild.bench.peers.transformers import HFBatch
    from tests.helpers import hf_greedy

    hf = tiny_hf_models["llama_gqa_llama3rope"]
    peer = HFBatch(hf, threads=1, max_new_tokens=MAX_NEW_TOKENS)
    peer.eos = set()  # random weights: run every request to max_new_tokens, as hf_greedy's generate may not stop
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    run = closed_loop(peer, PROMPTS, 3)
    assert [r.output_ids for r in run.done] == [hf_greedy(model, ids, MAX_NEW_TOKENS) for ids in PROMPTS]
    assert run.most_in_flight == 3 and all(0 <= r.ttft_s <= r.last_token_s <= r.latency_s for r in run.done)
    assert run.steps == 3 * MAX_NEW_TOKENS  # static: 7 prompts at 3 in flight are three batches
    assert peer.label == f"HF transformers static batch {hf.name}"


def test_transformers_static_batch_samples_with_its_seed(tiny_hf_models):
    """A sampled static batch draws after transformers' own warpers from a generator seeded by the batch's first
    request: the same seed repeats its tokens, another seed gives others."""
    from specbuild.bench.peers.transformers import HFBatch
    from specbuild.runtime.engine import SamplingParams

    peer = HFBatch(tiny_hf_models["llama_gqa_llama3rope"], threads=1, max_new_tokens=MAX_NEW_TOKENS)
    peer.eos = set()

    def outputs(seed):
        sampling = SamplingParams(temperature=1.5, top_k=20, top_p=0.95, seed=seed)
        return [r.output_ids for r in closed_loop(peer, PROMPTS, 3, sampling).done]

    assert outputs(1) == outputs(1) != outputs(2)
