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
from pathlib import Path

import numpy as np

from specbuild import engine_format as ef
from specbuild.errors import SpecbuildError
from specbuild.runtime.backends.base import create_backend, default_backend, select_graph
from specbuild.runtime.kv_cache import MIN_CAPACITY, GrowingCache, SharedKV, StackedKV
from specbuild.runtime.manifest import load_manifest
from specbuild.tree import Tree

NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16, "int64": np.int64, "bool": np.bool_}
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

    def __init__(self, engine_dir, backend: str | None = None, threads: int | None = None, graph: str | None = None):
        """backend: onnxruntime or tensorrt (default: tensorrt when the engine has a plan). graph: the backend whose
        graph to run (default: the backend's own; `Engine(d, graph="tensorrt")` runs the portable graph on ONNX
        Runtime, e.g. to check it against the fused one)."""
        threads = _check_threads(threads)
        self.path = Path(engine_dir)
        self.manifest = load_manifest(self.path)  # validated; recorded file sizes checked
        backend = backend or default_backend(self.manifest)
        self.graph = select_graph(self.manifest, graph or backend, self.path)
        try:
            self.backend = create_backend(self.path, self.manifest, backend, threads, graph=self.graph)
        except SpecbuildError:
            raise
        except Exception as exc:  # noqa: BLE001 - a damaged graph/weights file: ORT raises its own types
            onnx_file = self.path / self.graph["file"]
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            raise SpecbuildError(
                f"{onnx_file}: cannot load the engine graph ({reason}); the engine is damaged, rebuild it"
            ) from None
        model = self.manifest["model"]
        self.eos_ids = set(model.get("eos_token_ids") or [])
        self.max_seq_len = int(self.manifest["limits"]["max_seq_len"])
        self.kv_dtype = NUMPY_DTYPES["float16" if self.manifest["dtype"] == "float16" else "float32"]
        dims = (model["num_layers"], model["num_kv_heads"], model["head_dim"], self.kv_dtype, self.max_seq_len)
        if self.graph["kv_cache"] == ef.KV_SHARED:
            bind = getattr(self.backend, "bind", None)
            self.new_kv = lambda capacity: SharedKV(*dims, capacity, bind=bind)
        else:
            self.new_kv = lambda capacity: StackedKV(*dims, capacity)
        tree = self.manifest["tree"]
        source = f"{self.path / ef.ENGINE_MANIFEST}: field tree.choices"
        self.static_tree = None if tree.get("dynamic") else Tree.from_choices(tree["choices"], source=source)
        self.state_specs = self.manifest.get("states") or []
        self.output_names = {o["name"] for o in self.graph["io"]["outputs"]}
        self._codec = None

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

    # ------------------------------------------------------------------ one engine call
    def _call(
        self,
        kv: StackedKV | SharedKV,
        states: dict,
        input_ids,
        position_ids,
        tree_mask,
        paths,
        window: int,
        sampling: SamplingParams,
        rng,
    ):
        feeds = {
            ef.INPUT_IDS: input_ids,
            ef.POSITION_IDS: position_ids,
            ef.TREE_MASK: tree_mask,
            ef.PAST_LENGTH: np.array([kv.length], dtype=np.int64),
            ef.PATHS: paths,
            ef.TEMPERATURE: np.array([sampling.temperature], dtype=np.float32),
            ef.TOP_K: np.array([sampling.top_k], dtype=np.int64),
            ef.TOP_P: np.array([sampling.top_p], dtype=np.float32),
            ef.RAND_ACCEPT: rng.random((1, window), dtype=np.float32),
            ef.RAND_SAMPLE: rng.random(1, dtype=np.float32),
        }
        feeds.update(kv.feeds())
        for name, cache in states.items():
            feeds[ef.STATE_PREFIX + name] = cache.data if isinstance(cache, GrowingCache) else cache
        return self.backend.run(feeds, kv.aliases)

    def _new_states(self, capacity: int) -> dict:
        states = {}
        for spec in self.state_specs:
            dtype = NUMPY_DTYPES.get(spec["dtype"], self.kv_dtype)
            if spec["dtype"] == "float32" and self.kv_dtype == np.float16:
                dtype = np.float16
            shape = [1 if d == "B" else (0 if d == "C" else d) for d in spec["shape"]]
            if spec.get("grow_axis") is not None:
                states[spec["name"]] = GrowingCache(tuple(shape), spec["grow_axis"], dtype, self.max_seq_len, capacity)
            else:
                states[spec["name"]] = np.full(shape, spec.get("fill", 0), dtype=dtype)
        return states

    def _update_states(self, states: dict, out: dict, nodes: np.ndarray | None):
        for name, cache in states.items():
            if isinstance(cache, GrowingCache):
                cache.commit(out["new_state_" + name], nodes)
            else:
                states[name] = out["next_state_" + name]

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
        rng = np.random.default_rng(sampling.seed)
        start = time.perf_counter()
        engine_s = 0.0
        t = len(ids)
        step_tokens = int(self.manifest["limits"].get("max_new_tokens_per_step", 1))
        capacity = min(self.max_seq_len, max(MIN_CAPACITY, 1 << (t + step_tokens - 1).bit_length()))
        kv = self.new_kv(capacity)
        states = self._new_states(capacity)
        out = self._call(
            kv,
            states,
            np.array([ids], dtype=np.int64),
            np.arange(t, dtype=np.int64)[None],
            np.tril(np.ones((t, t), dtype=np.bool_))[None],
            np.array([[[t - 1]]], dtype=np.int64),
            1,
            sampling,
            rng,
        )
        engine_s += self.backend.last_engine_s
        kv.commit(out, None, t)
        self._update_states(states, out, None)
        generated: list[int] = []
        accepted_per_step: list[int] = []
        stop_reason = None
        ttft = None
        steps = 0

        def emit(tokens) -> str | None:
            nonlocal ttft
            for tok in tokens:
                generated.append(int(tok))
                if int(tok) in self.eos_ids:
                    return "eos"
                if len(generated) >= max_new_tokens:
                    return "max_new_tokens"
            return None

        n = int(out[ef.NUM_ACCEPTED][0])
        first = out[ef.ACCEPTED_TOKENS][0, :n]
        stop_reason = emit(first)
        ttft = time.perf_counter() - start
        if stream:
            stream(generated[:])
        while stop_reason is None:
            next_ids = out[ef.NEXT_INPUT_IDS]
            if self.static_tree is not None:
                tree = self.static_tree
                mask, offsets, paths = tree.ancestor_mask[None], tree.depths, tree.paths[None]
            else:
                mask = out["next_tree_mask"]
                offsets = out["next_position_offsets"][0]
                paths = out["next_paths"]
            size = next_ids.shape[1]
            if kv.length + size > self.max_seq_len:  # near the end: verify the root alone
                if kv.length + 1 > self.max_seq_len:
                    stop_reason = "max_seq_len"
                    break
                next_ids, mask, offsets = next_ids[:, :1], mask[:, :1, :1], offsets[:1]
                paths = np.zeros((1, 1, 1), dtype=np.int64)
                size = 1
            kv.ensure(kv.length + size)
            for cache in states.values():
                if isinstance(cache, GrowingCache):
                    cache.ensure(cache.length + size)
            positions = (kv.length + offsets).astype(np.int64)[None]
            out = self._call(kv, states, next_ids, positions, mask, paths, size, sampling, rng)
            engine_s += self.backend.last_engine_s
            steps += 1
            n = int(out[ef.NUM_ACCEPTED][0])
            nodes = out[ef.ACCEPTED_NODES][0, :n]
            kv.commit(out, nodes, size)
            self._update_states(states, out, nodes)
            accepted_per_step.append(n)
            stop_reason = emit(out[ef.ACCEPTED_TOKENS][0, :n])
            if stream:
                stream(generated[:])
        total = time.perf_counter() - start
        text = None
        if decode_text and self.manifest["files"].get("tokenizer"):
            text = self.codec.decode(generated)
        return GenerationResult(
            output_ids=generated,
            text=text,
            prompt_tokens=t,
            steps=steps,
            accepted_per_step=accepted_per_step,
            stop_reason=stop_reason,
            ttft_s=ttft,
            total_s=total,
            engine_s=engine_s,
            host_s=total - engine_s,
        )

    def prefill_logits(self, input_ids: list[int]) -> np.ndarray:
        """Logits [T,V] of every prompt position (needs an engine built with --output-logits)."""
        if ef.LOGITS not in self.output_names:
            raise SpecbuildError(f"{self.path}: engine was built without --output-logits")
        t = len(input_ids)
        capacity = max(MIN_CAPACITY, t)
        kv = self.new_kv(capacity)
        states = self._new_states(capacity)
        out = self._call(
            kv,
            states,
            np.array([input_ids], dtype=np.int64),
            np.arange(t, dtype=np.int64)[None],
            np.tril(np.ones((t, t), dtype=np.bool_))[None],
            np.array([[[t - 1]]], dtype=np.int64),
            t,
            SamplingParams(),
            np.random.default_rng(0),
        )
        return out[ef.LOGITS][0]
