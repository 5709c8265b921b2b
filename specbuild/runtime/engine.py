"""A loaded engine (graphs, manifest, tokenizer, the KV/state layout, the drafter's settings) and generation through
the scheduler (runtime/scheduler.py): `generate` submits one request to the engine's scheduler and runs it; many
requests at once go through `Engine.scheduler` (or a Scheduler of one's own) the same way.

Per step the host does O(accepted tokens) work per sequence: the batch commits the accepted nodes' KV and builds
the next call's small inputs (the cache itself is bound to the backend without a copy); each request takes its
accepted tokens and streams just those.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from specbuild import engine_format as ef
from specbuild.errors import SpecbuildError
from specbuild.modes.registry import get_mode, load_object
from specbuild.runtime import exactness, kernels
from specbuild.runtime.backends.base import resolve_threads
from specbuild.runtime.backends.factory import create_backend, default_backend, select_graph
from specbuild.runtime.integrity import verify_once
from specbuild.runtime.layout import Layout
from specbuild.runtime.manifest import load_manifest
from specbuild.runtime.sampling import SamplingParams
from specbuild.runtime.scheduler import Request, Scheduler
from specbuild.runtime.session import Session
from specbuild.runtime.speculation import resolve_policy


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
    prefill_engine_s: float = 0.0  # engine time of the prompt's calls; engine_s includes it
    token_times: list[float] = dataclasses.field(default_factory=list)  # s after submission, per output token

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


class Engine:
    """A loaded engine directory. `Engine("engine/").generate(prompt="...")`."""

    def __init__(
        self,
        engine_dir,
        backend: str | None = None,
        threads: int | None = None,
        graph: str | None = None,
        allow_lossy: bool = False,
        speculation: str | None = None,
        shared_cores: bool = False,
        draft_pool=None,
    ):
        """backend: onnxruntime or tensorrt (default: tensorrt when the engine has a plan). graph: the backend whose
        graph to run (default: the backend's own; `Engine(d, graph="tensorrt")` runs the portable graph on ONNX
        Runtime, e.g. to check it against the fused one). allow_lossy: run a speculative engine that cannot be exact
        on this CPU, labelled lossy (`exactness`), instead of refusing it. speculation: how the engine's scheduler
        drafts (runtime/speculation.py): auto (by measured cost), always, or off (roots only); default
        $SPECBUILD_SPECULATION, else auto. shared_cores: this engine runs between the calls of another one (a draft
        model's between its target's): its thread pool does not busy-wait after a call. The target's pool does: a
        draft-target step on SmolLM2 ran 14-17 % faster than with neither spinning (2 threads, AVX-512 EPYC).
        draft_pool: a directory where drafters that learn from traffic (suffix decoding) keep what they learnt,
        across runs (default: kept in memory for this process)."""
        self.speculation = resolve_policy(speculation)
        threads = resolve_threads(threads)
        self.path = Path(engine_dir)
        self.draft_pool = Path(draft_pool) if draft_pool is not None else None
        self.manifest = load_manifest(self.path)  # validated; recorded file sizes checked
        backend = backend or default_backend(self.manifest)
        self.graph = select_graph(self.manifest, graph or backend, self.path)
        own = backend == ef.BACKEND_ONNXRUNTIME and any(kernels.wanted(self.graph))  # runtime/kernels serve
        self.kernels_tag = kernels.tag() if own else "stock"  # the kernels its session is made with
        self.backend = self._load_backend(backend, threads, shared_cores)
        self.exactness = exactness.decide(self.path, self.manifest, self.graph, backend, threads, allow_lossy)
        self.layout = Layout.read(self.manifest, self.graph, self.exactness.min_rows)
        self._check_limits()
        self.eos_ids = set(self.manifest["model"].get("eos_token_ids") or [])
        mode = get_mode(self.manifest["speculative_mode"], option=f"{self.path / ef.ENGINE_MANIFEST}: speculative_mode")
        self.drafter_class = load_object(mode.drafter)
        # read and checked once: a bad tree or drafter setting fails at load; each sequence's drafter is built from it
        self.threads = threads
        self.drafter_settings = self.drafter_class.load_settings(self)
        self.output_names = {o["name"] for o in self.graph["io"]["outputs"]}
        self._codec = None
        self._scheduler: Scheduler | None = None
        self._cost_curve = None

    @property
    def max_seq_len(self) -> int:
        return self.layout.max_seq_len

    @property
    def min_rows(self) -> int:
        """Rows every call is padded to (row-invariant kernels; 1 = no padding)."""
        return self.layout.min_rows

    def _load_backend(self, backend: str, threads: int, shared_cores: bool):
        """The backend session, while the engine files' hashes are checked beside it (once per file identity)."""
        with ThreadPoolExecutor(1) as pool:
            hashing = pool.submit(verify_once, self.path, self.manifest["checksums"])
            try:
                loaded = create_backend(self.path, self.manifest, backend, threads, self.graph, shared_cores)
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
        limit = int(recorded) - self.layout.scratch_rows  # the scratch rows of padded calls sit after the last position
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
        return self.codec.prompt_ids(prompt, chat)

    # ------------------------------------------------------------------ generation
    def forget_traffic(self) -> None:
        """Drafters that learn from traffic (suffix decoding's pool, token recycling's table) start again from what
        they held at load: a benchmark that sends the same prompts again measures each run on its own. Nothing else
        is loaded again (a draft model's engine stays)."""
        self.drafter_settings = self.drafter_class.forget_traffic(self.drafter_settings)

    def learnt_memory(self) -> tuple[int, int]:
        """The bytes held by what the drafters learnt from traffic (suffix's pools, recycle's tables), and the most
        they may hold ((0, 0): its mode learns nothing)."""
        return self.drafter_class.learnt_memory(self.drafter_settings)

    def new_drafter(self, prompt: list[int], sampling: SamplingParams | None = None, options=None, tenant=None):
        """One sequence's drafter, built from the settings read at load (narrowed by the request's drafting
        `options`, e.g. a smaller window: Drafter.narrowed), for `tenant` (Drafter.for_tenant)."""
        settings = self.drafter_class.for_tenant(self.drafting_settings(options), tenant)
        return self.drafter_class(settings, prompt, sampling)

    def drafting_settings(self, options=None):
        """The drafter settings of a request with drafting `options` (checked: SpecbuildError naming the option)."""
        if not options:
            return self.drafter_settings
        return self.drafter_class.narrowed(self.drafter_settings, dict(options))

    def new_session(self, prompt: list[int], sampling: SamplingParams) -> Session:
        """One sequence driven call by call (runtime/session.py), with its own drafter."""
        return Session(
            self.layout,
            self.backend,
            sampling,
            len(prompt) + self.layout.step_tokens,
            self.new_drafter(prompt, sampling),
        )

    @property
    def scheduler(self) -> Scheduler:
        """The engine's scheduler (made on first use): every request of `generate` goes through it."""
        if self._scheduler is None:
            self._scheduler = Scheduler(self, speculation=self.speculation)
        return self._scheduler

    def cost_curve(self):
        """ms per call of B sequences x T tokens on this machine (runtime/speculation.CostCurve): each shape is
        measured on this engine's own graph the first time it is needed, and kept in the user cache."""
        if self._cost_curve is None:
            import onnxruntime as ort

            from specbuild.runtime import speculation
            from specbuild.runtime.row_invariance import cpu_description, cpu_key

            sha = self.manifest["checksums"][self.graph["file"]]["sha256"]
            key = f"{speculation.COST_VERSION}|{sha}|{cpu_key()}|{ort.__version__}|{self.threads}|{self.min_rows}"
            key += f"|{self.kernels_tag}"  # the kernels the graph runs on
            self._cost_batches: dict = {}
            self._cost_curve = speculation.CostCurve(
                self._timed_call,
                key,
                cpu_description(),
                self.layout.step_tokens,
                self.layout.max_batch_size,
                self.layout.selects_rows,
            )
        return self._cost_curve

    def _timed_call(self, batch: int, tokens: int, draft: bool = True) -> float:
        """Engine seconds of one call of `batch` sequences x `tokens` chained tokens after COST_CONTEXT cached ones,
        drafting the next trees or not (cost measurement; the sequences of a batch size are kept between calls, their
        cache contents are zeros)."""
        from specbuild.runtime.batch import Batch, Call, Sequence
        from specbuild.runtime.slots import initial_capacity
        from specbuild.runtime.speculation import COST_CONTEXT

        context = min(COST_CONTEXT, self.max_seq_len - tokens)
        run = self._cost_batches.get(batch)
        if run is None:
            run = Batch(self.layout, self.backend, batch, initial_capacity(self.layout, context + tokens))
            for _ in range(batch):
                run.add(Sequence(self.layout, SamplingParams()))
            self._cost_batches[batch] = run
        for array in (run.kv, *run.states.arrays.values()):  # every slot holds `context` positions
            array.lengths[:] = [context] * batch
        chain = np.tril(np.ones((tokens, tokens), dtype=np.bool_))
        offsets = np.arange(tokens, dtype=np.int64)
        call = Call(np.ones(tokens, dtype=np.int64), chain, offsets, offsets[None], tokens, False)
        before = run.engine_s
        run.run([call] * batch, draft)
        return run.engine_s - before

    def generate(
        self,
        prompt: str | None = None,
        input_ids: list[int] | None = None,
        max_new_tokens: int = 128,
        sampling: SamplingParams | None = None,
        stream: Callable[[list[int]], None] | None = None,
        chat: bool = False,
        decode_text: bool = True,
        stop: tuple[str, ...] | list[str] = (),
        draft_options=None,
    ) -> GenerationResult:
        """One request through the engine's scheduler. stream: called after every engine call with the tokens that
        call added to the output (never empty). stop: strings that end the output (the text stops before them).
        draft_options: this request's own drafting settings, where the mode has them (Drafter.narrowed)."""
        sampling = sampling or SamplingParams()
        ids = self._prompt_ids(prompt, input_ids, chat)
        request = Request(ids, max_new_tokens, sampling, tuple(stop), stream, draft_options=draft_options)
        handle = self.scheduler.submit(request)
        handle.wait()
        if handle.error is not None:
            raise handle.error
        return self.result(handle, decode_text)

    def result(self, handle, decode_text: bool = True) -> GenerationResult:
        """The GenerationResult of a finished request (runtime/scheduler.Handle)."""
        text = None
        if decode_text and self.manifest["files"].get("tokenizer"):
            text = self.codec.decode(handle.output_ids)
            if handle.stop_reason == "stop":
                text = _cut_at_stop(text, handle.request.stop)
        total = handle.finished_at or 0.0
        return GenerationResult(
            output_ids=list(handle.output_ids),
            text=text,
            prompt_tokens=len(handle.request.ids),
            steps=len(handle.accepted_per_step),
            accepted_per_step=list(handle.accepted_per_step),
            stop_reason=handle.stop_reason,
            ttft_s=handle.first_token_at or 0.0,
            total_s=total,
            engine_s=handle.engine_s,
            host_s=total - handle.engine_s,
            prefill_engine_s=handle.prefill_engine_s,
            token_times=list(handle.token_times),
        )

    def check_prompt(self, ids: list[int]) -> list[int]:
        """The prompt's ids as ints, checked against the vocabulary and max_seq_len (SpecbuildError)."""
        return self._prompt_ids(None, ids, False)

    def _prompt_ids(self, prompt: str | None, input_ids: list[int] | None, chat: bool) -> list[int]:
        """The prompt's token ids, checked against the vocabulary and max_seq_len."""
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
        return ids

    def prefill_logits(self, input_ids: list[int]) -> np.ndarray:
        """Logits [T,V] of every prompt position (needs an engine built with --output-logits)."""
        if ef.LOGITS not in self.output_names:
            raise SpecbuildError(f"{self.path}: engine was built without --output-logits")
        session = Session(self.layout, self.backend, SamplingParams(), len(input_ids))
        return session.prefill(input_ids, window=len(input_ids)).outputs[ef.LOGITS][0]


def _cut_at_stop(text: str, stops) -> str:
    """The text before the first stop string it holds."""
    cuts = [text.find(s) for s in stops if s and s in text]
    return text[: min(cuts)] if cuts else text
