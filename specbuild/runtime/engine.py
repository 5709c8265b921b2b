"""The generation loop: feed the step graph's outputs back in, commit accepted KV, stop on EOS or length.

Per step the host does O(accepted tokens) work: it copies the accepted nodes' new KV into the cache and
builds the next call's small inputs; the cache itself is bound to the engine without a copy.
"""

from __future__ import annotations

import dataclasses
import numbers
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from specbuild import engine_format as ef
from specbuild.errors import SpecbuildError
from specbuild.plugins.registry import get_mode, load_object
from specbuild.runtime import exactness
from specbuild.runtime.backends.factory import create_backend, default_backend, select_graph
from specbuild.runtime.drafter import Proposal, SequenceState
from specbuild.runtime.integrity import verify_once
from specbuild.runtime.kv_cache import SharedKV, StackedKV
from specbuild.runtime.manifest import load_manifest
from specbuild.runtime.session import NUMPY_DTYPES, Session

FLOAT32_MAX = float(np.finfo(np.float32).max)


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_integer(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclasses.dataclass
class SamplingParams:
    """temperature 0 = greedy. top_k 0 and top_p 1 switch those filters off. Same seed -> same output.

    A sampling temperature must be at least MIN_TEMPERATURE (1e-5): the step graph divides the logits by
    max(temperature, 1e-5), so a smaller one would silently act as 1e-5 and is refused instead.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        t = self.temperature
        if not _is_real(t) or not (t == 0 or ef.MIN_TEMPERATURE <= t <= FLOAT32_MAX):
            raise SpecbuildError(
                f"--temperature must be 0 (greedy) or a finite number >= {ef.MIN_TEMPERATURE:g}, got {t!r}"
            )
        p = self.top_p
        if not _is_real(p) or not 0 < p <= 1:  # NaN fails both comparisons
            raise SpecbuildError(f"--top-p must be a number in (0, 1] (1 = off), got {p!r}")
        if not _is_integer(self.top_k) or not 0 <= self.top_k <= ef.MAX_TOP_K:
            raise SpecbuildError(
                f"--top-k must be an integer in [0, {ef.MAX_TOP_K}] (0 = off; the engine's filters work over the "
                f"{ef.MAX_TOP_K} most likely tokens), got {self.top_k!r}"
            )
        if not _is_integer(self.seed) or self.seed < 0:
            raise SpecbuildError(f"--seed must be an integer >= 0, got {self.seed!r}")
        self.temperature, self.top_p = float(t), float(p)
        self.top_k, self.seed = int(self.top_k), int(self.seed)


@dataclasses.dataclass
class GenerationResult:
    output_ids: list[int]
    text: str | None
    prompt_tokens: int
    steps: int
    accepted_per_step: list[int]
    stop_reason: str
    ttft_s: float
    total_s: float
    engine_s: float
    host_s: float
    prefill_engine_s: float = 0.0  # engine time of the first call (the prompt); engine_s includes it

    @property
    def mean_accepted_tokens(self) -> float:
        """τ: tokens per engine call after prefill (accepted drafts + the bonus token)."""
        return float(np.mean(self.accepted_per_step)) if self.accepted_per_step else 0.0

    @property
    def tokens_per_s(self) -> float:
        return len(self.output_ids) / self.total_s if self.total_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        n = len(self.output_ids) - 1
        t = self.total_s - self.ttft_s
        return n / t if n > 0 and t > 0 else 0.0

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out.update(
            mean_accepted_tokens=self.mean_accepted_tokens,
            tokens_per_s=self.tokens_per_s,
            decode_tokens_per_s=self.decode_tokens_per_s,
        )
        return out


def _check_threads(threads):
    """None (ONNX Runtime's default, or SPECBUILD_THREADS) or an integer >= 1."""
    if threads is None:
        env = os.environ.get("SPECBUILD_THREADS", "").strip()
        if env and not env.isdigit():
            raise SpecbuildError(f"SPECBUILD_THREADS must be an integer >= 0 (0 = default), got {env!r}")
        return None
    if not _is_integer(threads) or threads < 1:
        raise SpecbuildError(f"--threads must be an integer >= 1, got {threads!r}")
    return int(threads)


class Engine:
    """A loaded engine directory. `Engine("engine/").generate(prompt="...")`."""

    def __init__(
        self,
        engine_dir,
        backend: str | None = None,
        threads: int | None = None,
        graph: str | None = None,
        allow_lossy: bool = False,
    ):
        """backend: onnxruntime or tensorrt (default: tensorrt when the engine has a plan). graph: the backend whose
        graph to run (default: the backend's own; `Engine(d, graph="tensorrt")` runs the portable graph on ONNX
        Runtime, e.g. to check it against the fused one). allow_lossy: run a speculative engine that cannot be exact
        on this CPU, labelled lossy (`exactness`), instead of refusing it."""
        threads = _check_threads(threads)
        self.path = Path(engine_dir)
        self.manifest = load_manifest(self.path)  # validated; recorded file sizes checked
        backend = backend or default_backend(self.manifest)
        self.graph = select_graph(self.manifest, graph or backend, self.path)
        self.backend = self._load_backend(backend, threads)
        # the graph writes attention_pad_rows scratch rows after each call's tokens: the cache keeps room for them
        self.attention_pad = int(self.graph.get("attention_pad_rows", 0))
        self.exactness = exactness.decide(self.path, self.manifest, self.graph, backend, threads, allow_lossy)
        self.min_rows = self.exactness.min_rows  # every call is padded to this many rows (row-invariant kernels)
        self.scratch_rows = max(self.attention_pad, self.min_rows - 1)
        model = self.manifest["model"]
        self.eos_ids = set(model.get("eos_token_ids") or [])
        self.max_seq_len = int(self.manifest["limits"]["max_seq_len"])
        self._check_limits()
        self.kv_dtype = NUMPY_DTYPES["float16" if self.manifest["dtype"] == "float16" else "float32"]
        dims = (
            model["num_layers"],
            model["num_kv_heads"],
            model["head_dim"],
            self.kv_dtype,
            self.max_seq_len + self.scratch_rows,
        )
        if self.graph["kv_cache"] == ef.KV_SHARED:
            bind = getattr(self.backend, "bind", None)
            self.new_kv = lambda capacity: SharedKV(*dims, capacity, bind=bind)
        else:
            self.new_kv = lambda capacity: StackedKV(*dims, capacity)
        mode = get_mode(self.manifest["speculative_mode"], option=f"{self.path / ef.ENGINE_MANIFEST}: speculative_mode")
        self.drafter_class = load_object(mode.drafter)
        self.drafter_class(self.manifest, str(self.path / ef.ENGINE_MANIFEST))  # a bad tree/settings fail at load
        self.state_specs = self.manifest.get("states") or []
        self.output_names = {o["name"] for o in self.graph["io"]["outputs"]}
        self._codec = None

    def _load_backend(self, backend: str, threads: int | None):
        """The backend session, while the engine files' hashes are checked beside it (once per file identity)."""
        with ThreadPoolExecutor(1) as pool:
            hashing = pool.submit(verify_once, self.path, self.manifest["checksums"])
            try:
                loaded = create_backend(self.path, self.manifest, backend, threads, graph=self.graph)
            except SpecbuildError:
                hashing.result()  # a damaged file explains a failed load best
                raise
            except Exception as exc:  # noqa: BLE001 - a damaged graph/weights file: ORT raises its own types
                hashing.result()
                onnx_file = self.path / self.graph["file"]
                reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
                raise SpecbuildError(
                    f"{onnx_file}: cannot load the engine graph ({reason}); the engine is damaged, rebuild it"
                ) from None
            hashing.result()
        return loaded

    def _check_limits(self) -> None:
        """engine.yaml's limits against what the graph file (hashed) says it can do."""
        recorded = self.backend.graph_metadata().get(ef.GRAPH_MAX_POSITIONS)
        if recorded is None:
            return  # built before graphs recorded it, or a TensorRT plan (its profile bounds the shapes)
        limit = int(recorded) - self.scratch_rows  # the scratch rows of padded calls sit after the last position
        if self.max_seq_len > limit:
            raise SpecbuildError(
                f"{self.path / ef.ENGINE_MANIFEST}: limits.max_seq_len {self.max_seq_len} exceeds the {limit} "
                f"positions the graph {self.graph['file']} was built for; set it back (<= {limit}) or rebuild the "
                f"engine with a larger --max-seq-len"
            )

    @property
    def lossless(self) -> bool:
        """What this engine promises on this machine (engine.yaml's lossless, confirmed or withdrawn at load)."""
        return self.exactness.lossless

    @property
    def codec(self):
        if self._codec is None:
            tok = self.manifest["files"].get("tokenizer")
            if not tok:
                raise SpecbuildError(f"{self.path}: engine has no tokenizer.json; pass --input-ids instead of text")
            from specbuild.runtime.text import TextCodec

            file = self.path / tok
            if not file.is_file():
                raise SpecbuildError(f"{file}: tokenizer file missing from the engine directory; rebuild the engine")
            try:
                self._codec = TextCodec(file, self.manifest.get("chat_template"))
            except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exception on a damaged file
                reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
                raise SpecbuildError(f"{file}: cannot read the tokenizer ({reason})") from None
        return self._codec

    def encode_prompt(self, prompt: str, chat: bool = False) -> list[int]:
        text = self.codec.apply_chat(prompt) if chat else prompt
        return self.codec.encode(text)

    # ------------------------------------------------------------------ generation
    def generate(
        self,
        prompt: str | None = None,
        input_ids: list[int] | None = None,
        max_new_tokens: int = 128,
        sampling: SamplingParams | None = None,
        stream: Callable[[list[int]], None] | None = None,
        chat: bool = False,
        decode_text: bool = True,
    ) -> GenerationResult:
        sampling = sampling or SamplingParams()
        if not _is_integer(max_new_tokens) or max_new_tokens < 1:
            raise SpecbuildError(f"--max-new-tokens must be an integer >= 1, got {max_new_tokens!r}")
        if input_ids is None:
            if prompt is None:
                raise SpecbuildError("give a prompt or input ids")
            input_ids = self.encode_prompt(prompt, chat=chat)
        ids = [int(i) for i in input_ids]
        vocab = self.manifest["model"]["vocab_size"]
        if not ids:
            raise SpecbuildError("the prompt is empty")
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise SpecbuildError(f"input id {bad[0]} is outside the vocabulary (size {vocab})")
        if len(ids) >= self.max_seq_len:
            raise SpecbuildError(
                f"prompt has {len(ids)} tokens but the engine's max_seq_len is {self.max_seq_len}; "
                f"rebuild with a larger --max-seq-len or shorten the prompt"
            )
        start = time.perf_counter()
        t = len(ids)
        step_tokens = int(self.manifest["limits"].get("max_new_tokens_per_step", 1))
        session = Session(self, t + step_tokens, sampling, np.random.default_rng(sampling.seed))
        out = session.prefill(ids)
        prefill_engine_s = session.engine_s
        drafter = self.drafter_class(self.manifest, str(self.path / ef.ENGINE_MANIFEST))
        seq = SequenceState(tokens=list(ids), outputs=out, prompt_length=t)
        generated: list[int] = []
        accepted_per_step: list[int] = []

        def emit(tokens) -> str | None:
            """Append accepted tokens to the output; the reason to stop, if any."""
            for tok in tokens:
                generated.append(int(tok))
                if int(tok) in self.eos_ids:
                    return "eos"
                if len(generated) >= max_new_tokens:
                    return "max_new_tokens"
            return None

        def accept(out) -> str | None:
            accepted = out[ef.ACCEPTED_TOKENS][0, : int(out[ef.NUM_ACCEPTED][0])]
            stop = emit(accepted)
            seq.outputs = out
            seq.tokens.extend(int(x) for x in accepted)
            drafter.observe(seq)
            if stream:
                stream(generated[:])
            return stop

        stop_reason = accept(out)
        ttft = time.perf_counter() - start
        while stop_reason is None:
            proposal: Proposal = drafter.propose(seq)
            if not session.fits(proposal.size):  # near the end of the cache: verify the root alone
                if not session.fits(1):
                    stop_reason = "max_seq_len"
                    break
                proposal = proposal.root_only()
            out = session.verify(proposal)  # one engine call: verify, accept, commit the accepted KV
            accepted_per_step.append(int(out[ef.NUM_ACCEPTED][0]))
            stop_reason = accept(out)
        total = time.perf_counter() - start
        text = None
        if decode_text and self.manifest["files"].get("tokenizer"):
            text = self.codec.decode(generated)
        return GenerationResult(
            output_ids=generated,
            text=text,
            prompt_tokens=t,
            steps=len(accepted_per_step),
            accepted_per_step=accepted_per_step,
            stop_reason=stop_reason,
            ttft_s=ttft,
            total_s=total,
            engine_s=session.engine_s,
            host_s=total - session.engine_s,
            prefill_engine_s=prefill_engine_s,
        )

    def prefill_logits(self, input_ids: list[int]) -> np.ndarray:
        """Logits [T,V] of every prompt position (needs an engine built with --output-logits)."""
        if ef.LOGITS not in self.output_names:
            raise SpecbuildError(f"{self.path}: engine was built without --output-logits")
        session = Session(self, len(input_ids), SamplingParams(), np.random.default_rng(0))
        return session.prefill(input_ids, window=len(input_ids))[ef.LOGITS][0]
