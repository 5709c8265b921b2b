"""The scheduler: many requests through one engine, in-flight (continuous) batching; the one generation loop.

Requests are submitted and cancelled at any time (from any thread). Each `step()`:
1. drops cancelled requests (their KV slot is freed at once);
2. admits waiting requests while KV slots are free (requests beyond the engine's slots wait);
3. prefills the requests being admitted, `prefill_chunk` prompt tokens per step in all (a chunk per call, each
   request in a staging slot of its own), so that a long prompt or a burst of arrivals never stalls the others for
   more than that many tokens; after its last chunk a request joins the batch (its cache is copied into a slot:
   O(prompt));
4. runs one engine call for every running request: each proposes with its own drafter (propose -> verify/accept
   -> commit), the step verifies the whole proposals, the first tokens of chains, or only the roots, as
   runtime/speculation.py decides from the engine's measured cost (which also decides whether a graph that drafts
   the next trees drafts them this call, or the rows decode plainly), and each request takes its accepted tokens up
   to EOS, its max_new_tokens, a stop string or the context limit. A finished request leaves the batch.
Each request gets only its new tokens: a callback, an iterator or an async iterator. `Engine.generate`, `specbuild
run` and `specbuild bench` all go through here (batch 1 is one request in the batch).

Modes whose graph keeps per-position state (EAGLE's draft KV) prefill a prompt in one call: a chunk boundary would
draft that state from a sampled token instead of the prompt's next one.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import queue
import threading
import time
from collections.abc import Callable

import numpy as np

from specbuild.errors import SpecbuildError
from specbuild.runtime.batch import Batch, Call, Sequence
from specbuild.runtime.drafter import Proposal, StepResult
from specbuild.runtime.sampling import SamplingParams
from specbuild.runtime.slots import initial_capacity
from specbuild.runtime.speculation import Shape, Speculation, resolve_policy

DEFAULT_PREFILL_CHUNK = 256
_DONE = object()


@dataclasses.dataclass
class Request:
    """One generation: prompt ids, length limit, sampling, stop strings and an optional callback that gets each
    step's new tokens (never empty)."""

    ids: list[int]
    max_new_tokens: int = 128
    sampling: SamplingParams | None = None  # greedy when None
    stop: tuple[str, ...] = ()
    on_tokens: Callable[[list[int]], None] | None = None
    draft_options: dict | None = None  # the request's own drafting settings (Drafter.narrowed), where a mode has them
    # whom the request is for (serve: its API key, hashed; None: anyone): what drafters that learn from traffic learn
    # from one tenant's requests serves that tenant's alone (Drafter.for_tenant)
    tenant: str | None = None


class Handle:
    """A submitted request: its output so far, timings, and its stream of new tokens (iterate it, or `async for`
    over `stream()`)."""

    _ids = itertools.count(1)

    def __init__(self, request: Request, scheduler: Scheduler):
        self.id = next(self._ids)
        self.request = request
        self.scheduler = scheduler
        self.output_ids: list[int] = []
        self.accepted_per_step: list[int] = []  # tokens each decode step accepted (drafts + the bonus token)
        self.drafted_per_step: list[int] = []  # draft tokens each decode step verified
        self.stop_reason: str | None = None
        self.error: BaseException | None = None
        self.arrival = time.perf_counter()
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.token_times: list[float] = []  # seconds after arrival at which each output token was emitted
        self.prefill_engine_s = 0.0
        self.sequence: Sequence | None = None
        self.done = threading.Event()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._prefilled = 0  # prompt tokens in the staging slot
        self._prefill_ids: list[int] = request.ids  # what the staging slot prefills: the prompt (or see restage)
        self._staging: Batch | None = None
        self._staged_s = 0.0  # engine seconds of the staging slot counted in prefill_engine_s

    @property
    def finished(self) -> bool:
        return self.done.is_set()

    @property
    def engine_s(self) -> float:
        return self.sequence.engine_s if self.sequence is not None else 0.0

    def cancel(self) -> None:
        self.scheduler.cancel(self)

    def wait(self, timeout: float | None = None) -> bool:
        """Run the scheduler in this thread until the request ends (unless a background thread runs it)."""
        if self.scheduler.running_in_background:
            return self.done.wait(timeout)
        while not self.done.is_set():
            self.scheduler.step()
        return True

    def __iter__(self):
        """New tokens after each step, until the request ends (drives the scheduler when nothing else does)."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                if self.scheduler.running_in_background:
                    item = self._queue.get()
                else:
                    self.scheduler.step()
                    continue
            if item is _DONE:
                if self.error is not None:
                    raise self.error
                return
            yield item

    async def stream(self):
        """Async iterator of new tokens (needs the scheduler running in a background thread: `start()`)."""
        loop = asyncio.get_running_loop()
        while True:
            item = await loop.run_in_executor(None, self._queue.get)
            if item is _DONE:
                if self.error is not None:
                    raise self.error
                return
            yield item

    # ---- its state, changed by the scheduler through these
    def stage(self, sequence: Sequence, staging: Batch, ids: list[int] | None = None) -> None:
        """The request's sequence is prefilled in `staging` (a one-slot batch holding it): its prompt, or `ids`."""
        self.sequence, self._staging = sequence, staging
        self._prefill_ids = self.request.ids if ids is None else ids
        self._prefilled = 0
        self._staged_s = 0.0

    def restage(self, staging: Batch) -> None:
        """Prefill every token again (prompt and output) in `staging` (LongRoPE's switch: Scheduler._recompute)."""
        self.stage(self.sequence, staging, [*self.request.ids, *self.output_ids])

    @property
    def prefill_left(self) -> int:
        """Tokens of the staged prefill not run yet."""
        return len(self._prefill_ids) - self._prefilled

    def prefill(self, budget: int | None, drafting: bool):
        """Run the next chunk of the staged prefill (at most `budget` tokens; None: the rest) in the staging slot:
        (its StepResult, the tokens it ran). The chunk's engine time counts as the request's prefill time."""
        start = self._prefilled
        end = len(self._prefill_ids) if budget is None else min(len(self._prefill_ids), start + budget)
        result = self._staging.run([Call.prompt(self._prefill_ids[start:end])], drafting)[0]
        self.prefill_engine_s += self._staging.engine_s - self._staged_s
        self._staged_s = self._staging.engine_s
        self._prefilled = end
        return result, end - start

    def unstage(self) -> Batch:
        """The staging slot, its prefill done (the sequence's caches join the running batch from it)."""
        staging, self._staging = self._staging, None
        return staging

    def record_step(self, verified: int, accepted: int) -> None:
        """A decode step verified `verified` tokens (drafts + root) of this request and accepted `accepted`."""
        self.drafted_per_step.append(verified - 1)
        self.accepted_per_step.append(accepted)

    def emit(self, tokens: list[int], eos_ids, codec) -> None:
        """Take a step's accepted tokens up to EOS, the length limit or a stop string; stream the new ones."""
        request = self.request
        stop, count = None, len(tokens)
        for i, token in enumerate(tokens):
            if token in eos_ids:
                stop, count = "eos", i + 1
                break
            if len(self.output_ids) + i + 1 >= request.max_new_tokens:
                stop, count = "max_new_tokens", i + 1
                break
        if request.stop:
            cut = _stop_string_end(codec, self.output_ids, tokens[:count], request.stop)
            if cut is not None:
                stop, count = "stop", cut
        new = tokens[:count]
        now = time.perf_counter() - self.arrival
        if self.first_token_at is None:
            self.first_token_at = now
        self.output_ids.extend(new)
        self.token_times.extend([now] * len(new))
        if new:
            if request.on_tokens is not None:
                request.on_tokens(new)
            self._queue.put(new)
        if stop is not None:
            self.stop_reason = stop

    def finish(self, reason: str | None = None, error: BaseException | None = None) -> None:
        """The request ends (`reason`: why, unless its tokens already said; `error`: what failed)."""
        if self.stop_reason is None:
            self.stop_reason = reason
        self.error = error
        self.finished_at = time.perf_counter() - self.arrival
        drafter = self.sequence.drafter if self.sequence is not None else None
        if drafter is not None:
            try:
                drafter.finish(self.output_ids, "error" if error is not None else self.stop_reason)
            except Exception:  # noqa: BLE001 - a drafter's bookkeeping never fails a request that has ended
                pass
        self._staging = None
        self._queue.put(_DONE)
        self.done.set()


def _stop_string_end(codec, before: list[int], new: list[int], stops) -> int | None:
    """How many of `new` tokens to keep so that the output ends with the token completing the first stop string
    (None: no stop string completes within them). Only the text near the new tokens is decoded."""
    longest = max(len(s) for s in stops)
    context = before[-(longest + 2) :]
    start_text = codec.decode(context)
    for k in range(1, len(new) + 1):
        text = codec.decode(context + new[:k])
        # a stop string that ends after the text we had before this step's tokens
        tail = text[max(0, len(start_text) - longest + 1) :]
        if any(s in tail for s in stops):
            return k
    return None


class Scheduler:
    """In-flight batching over one engine (see the module docstring)."""

    def __init__(
        self,
        engine,
        max_batch_size: int | None = None,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        speculation: str | None = None,
    ):
        layout = engine.layout
        slots = engine.layout.max_batch_size
        if max_batch_size is not None:
            if not 1 <= max_batch_size <= slots:
                raise SpecbuildError(
                    f"--max-batch-size {max_batch_size} is outside [1, {slots}] (the engine's KV slots, "
                    f"limits.max_batch_size; rebuild with a larger --max-batch-size)"
                )
            slots = max_batch_size
        if prefill_chunk < 1:
            raise SpecbuildError(f"--prefill-chunk must be an integer >= 1, got {prefill_chunk!r}")
        self.engine = engine
        self.layout = layout
        self.batch = Batch(layout, engine.backend, slots, initial_capacity(layout, 0))
        # a graph that keeps per-position state (EAGLE's draft KV) is prefilled a whole prompt per call
        self.chunked = not any(s.grow_axis is not None for s in layout.states)
        self.prefill_chunk = prefill_chunk
        self.speculation = Speculation(
            resolve_policy(speculation or engine.speculation), engine.cost_curve, layout.selects_rows
        )
        # whether the last decode step drafted (a graph that can skip its drafting prefills without it while the
        # running rows decode plainly: a prompt's drafting is what a loaded step would not pay for)
        self._drafting = self.speculation.policy != "off"
        self._waiting: collections.deque[Handle] = collections.deque()
        self._admitting: list[Handle] = []  # being prefilled, in arrival order (each holds a slot)
        self._running: dict[int, Handle] = {}  # id(sequence) -> handle
        self._cancel: set[Handle] = set()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._stepping = threading.Lock()  # one step at a time, whichever thread drives it
        self.steps = 0

    # ------------------------------------------------------------------ requests
    def submit(self, request: Request) -> Handle:
        """Queue a request (checked now: a prompt beyond the engine's context is refused, SpecbuildError)."""
        if request.sampling is None:
            request.sampling = SamplingParams()
        request.ids = self.engine.check_prompt(request.ids)
        _check_max_new_tokens(request.max_new_tokens)
        request.stop = tuple(s for s in (request.stop or ()) if s)
        self.engine.drafting_settings(request.draft_options)  # bad drafting options are refused now
        handle = Handle(request, self)
        with self._wake:
            if self._stopping:
                raise SpecbuildError("the scheduler is stopping: no new requests")
            self._waiting.append(handle)
            self._wake.notify()
        return handle

    def cancel(self, handle: Handle) -> None:
        """End a request at the next step (its tokens so far stay; stop_reason "cancelled")."""
        with self._wake:
            if not handle.finished:
                self._cancel.add(handle)
                self._wake.notify()

    @property
    def idle(self) -> bool:
        return not (self._waiting or self._admitting or self._running)

    @property
    def active(self) -> int:
        """Requests holding a KV slot or being prefilled."""
        return len(self._running) + len(self._admitting)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def kv_memory(self) -> tuple[int, int]:
        """The KV slots' bytes held and their bound (Batch.memory; read from any thread, a moment's figure)."""
        return self.batch.memory()

    # ------------------------------------------------------------------ the loop
    def step(self) -> bool:
        """One scheduler step (see the module docstring); False when there was nothing to do."""
        with self._stepping:
            return self._step()

    def _step(self) -> bool:
        self._apply_cancellations()
        self._admit()
        did = False
        budget = self.prefill_chunk  # prompt tokens this step, shared by the requests being admitted
        for handle in list(self._admitting):
            if budget <= 0:
                break
            budget -= self._prefill_chunk(handle, budget)
            did = True
        if self._running:
            self._decode()
            did = True
        self.steps += did
        return did

    def run_until_idle(self) -> None:
        while self.step():
            pass

    def _apply_cancellations(self) -> None:
        with self._lock:
            cancelled, self._cancel = self._cancel, set()
            for handle in cancelled:
                if handle in self._waiting:
                    self._waiting.remove(handle)
        for handle in cancelled:
            if handle in self._admitting:
                self._admitting.remove(handle)
            elif handle.sequence is not None and id(handle.sequence) in self._running:
                self._leave(handle)
            handle.finish("cancelled")

    def _admit(self) -> None:
        """Waiting requests take the free KV slots (their prefill starts this step)."""
        while self.active < self.batch.slots:
            with self._lock:
                if not self._waiting:
                    return
                handle = self._waiting.popleft()
            request = handle.request
            try:
                drafter = self.engine.new_drafter(request.ids, request.sampling, request.draft_options, request.tenant)
                sequence = Sequence(self.layout, request.sampling, drafter)
                sequence.long_rope = self.layout.long_rope(len(request.ids))
                handle.stage(sequence, self._staging_batch(sequence, len(request.ids)))
            except Exception as exc:  # noqa: BLE001 - a request's failure ends that request only
                handle.finish("error", exc)
                continue
            self._admitting.append(handle)

    def _prefill_chunk(self, handle: Handle, budget: int) -> int:
        """The next chunk (at most `budget` tokens) of a request's prompt (or, recomputed at LongRoPE's switch, of all
        its tokens: _recompute) in its staging slot; after the last one the request joins the batch. Returns the
        tokens prefilled."""
        try:
            result, count = handle.prefill(budget if self.chunked else None, self._drafting)
        except Exception as exc:  # noqa: BLE001
            self._admitting.remove(handle)
            handle.finish("error", exc)
            return min(budget, handle.prefill_left) if self.chunked else handle.prefill_left
        if handle.prefill_left:
            return count  # a chunk: its accepted token is not the request's (the prompt goes on)
        self._admitting.remove(handle)
        handle.emit(result.tokens, self.engine.eos_ids, self._codec(handle))
        if handle.stop_reason is not None:
            handle.finish()
            return count
        self.batch.add(handle.sequence, staged=handle.unstage())
        self._running[id(handle.sequence)] = handle
        return count

    def _decode(self) -> None:
        switch = self.layout.rope_switch
        if switch is not None:  # the next token's position is LongRoPE's switch: the caches are recomputed
            for seq, n in list(zip(self.batch.sequences, self.batch.lengths())):
                if not seq.long_rope and n >= switch:
                    self._recompute(self._running[id(seq)])
            if not self.batch.sequences:
                return
        batch = self.batch
        sequences = list(batch.sequences)
        handles = [self._running[id(s)] for s in sequences]
        lengths = batch.lengths()
        room = min(self.layout.max_seq_len - n for n in lengths)
        full = [h for h, n in zip(handles, lengths) if n >= self.layout.max_seq_len]
        if full:  # not even the root fits: those requests end here
            for handle in full:
                self._leave(handle)
                handle.finish("max_seq_len")
            return
        # a sequence below LongRoPE's switch verifies no position past it (_recompute took those at the switch)
        switch = self.layout.rope_switch
        rooms = [room if switch is None or s.long_rope else min(room, switch - n) for s, n in zip(sequences, lengths)]
        proposals = []
        budget = self._draft_budget(sequences)
        for handle, seq in zip(handles, sequences):
            if seq.drafter.paid_drafts:
                seq.drafter.limit, seq.drafter.batched = budget, len(sequences) > 1
            try:
                proposals.append(seq.drafter.propose(seq.last))
            except Exception as exc:  # noqa: BLE001 - a drafter's failure ends its request only
                self._leave(handle)
                handle.finish("error", exc)
        if len(proposals) < len(handles):
            return  # the batch changed: the next step proposes again
        fitting = [p if p.size <= r else p.root_only() for p, r in zip(proposals, rooms)]
        shapes = [Shape.of(p) for p in fitting]
        draft = self.speculation.drafts(shapes)  # this call drafts the next trees
        self._drafting = draft
        tokens = self.speculation.plan(shapes) if draft else 1
        calls = [Call.tree(_verified_part(p, tokens)) for p in fitting]
        self.speculation.count(tokens, [c.size for c in calls])
        try:
            results = batch.run(calls, draft)
        except Exception as exc:  # noqa: BLE001 - the engine failed: every running request ends with the error
            for handle in handles:
                self._leave(handle)
                handle.finish("error", exc)
            return
        self.speculation.timed(len(calls), max(c.size for c in calls), batch.backend.last_engine_s)
        for seq, proposal, result in zip(sequences, proposals, results):
            self.speculation.observe(id(seq), proposal, result.tokens)
        for handle, call, result in zip(handles, calls, results):
            handle.record_step(call.size, len(result.tokens))
            handle.emit(result.tokens, self.engine.eos_ids, self._codec(handle))
            if handle.stop_reason is not None:
                self._leave(handle)
                handle.finish()

    def _recompute(self, handle: Handle) -> None:
        """LongRoPE: a sequence whose next position is the switch leaves the batch and prefills all its tokens again
        in a staging slot, every position rotated with the long factors (what transformers' Phi-3 does when its
        sequence grows past original_max_position_embeddings: it drops the cache and recomputes it); that prefill's
        token is the sequence's next, then it rejoins the batch (_prefill_chunk). Once per request."""
        seq = handle.sequence
        self.batch.remove(seq)
        del self._running[id(seq)]
        seq.long_rope = True
        handle.restage(self._staging_batch(seq, len(handle.request.ids) + len(handle.output_ids)))
        self._admitting.append(handle)

    def _staging_batch(self, sequence: Sequence, tokens: int) -> Batch:
        """A one-slot batch holding `sequence`, sized for a prefill of `tokens` tokens."""
        staging = Batch(self.layout, self.engine.backend, 1, initial_capacity(self.layout, tokens))
        staging.add(sequence)
        return staging

    def _draft_budget(self, sequences) -> int | None:
        """Tokens per row worth drafting this step for drafters that pay per draft (a draft model): the tokens the
        cost model would verify at this batch size, the drafts' own cost included; None: no such drafter."""
        paying = [s.drafter for s in sequences if s.drafter.paid_drafts]
        if not paying:
            return None
        longest = self.layout.step_tokens
        return self.speculation.budget(
            len(sequences), longest, paying[0].draft_ms(), paying[0].expected_tokens(longest, len(sequences) > 1)
        )

    def _leave(self, handle: Handle) -> None:
        self.speculation.forget(id(handle.sequence))
        self.batch.remove(handle.sequence)
        del self._running[id(handle.sequence)]

    def _codec(self, handle: Handle):
        return self.engine.codec if handle.request.stop else None

    # ------------------------------------------------------------------ background thread
    @property
    def running_in_background(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> Scheduler:
        """Run steps in a background thread while there is work (submit/cancel from any thread)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="specbuild-scheduler", daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        while True:
            with self._wake:
                while self.idle and not self._cancel and not self._stopping:
                    self._wake.wait()
                if self._stopping and self.idle:
                    return
            self.step()

    def stop(self, cancel: bool = False, timeout: float | None = None) -> None:
        """Refuse new requests; finish (or cancel) what is in flight; end the background thread."""
        with self._wake:
            self._stopping = True
            if cancel:
                self._cancel.update(self._waiting)
                self._cancel.update(self._admitting)
                self._cancel.update(self._running.values())
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        else:
            self.run_until_idle()


def _verified_part(proposal: Proposal, tokens: int) -> Proposal:
    """What a row verifies in a step of `tokens` tokens per row: its whole proposal, a chain's first tokens, or the
    root alone."""
    if proposal.size <= tokens:
        return proposal
    return proposal.chain_prefix(tokens) if Shape.of(proposal).chain else proposal.root_only()


def _check_max_new_tokens(value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise SpecbuildError(f"--max-new-tokens must be an integer >= 1, got {value!r}")


__all__ = ["Handle", "Request", "Scheduler", "StepResult"]
