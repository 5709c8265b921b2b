"""Hugging Face transformers (--hf-model-dir): `generate`, greedy or sampled, and its prompt lookup decoding; with
--hf-assistant-dir its assisted generation with a draft model; under load a static batch of the requests waiting."""

from __future__ import annotations

import inspect
import time
from pathlib import Path

from specbuild.bench import decoding
from specbuild.bench.peers.base import PeerOption, PeerStack, StaticBatch
from specbuild.bench.results import Sample
from specbuild.errors import SpecbuildError


class HFTimer:
    """transformers' `generate` on the same ids (greedy or sampled): full generation and a 1-token generate for
    TTFT; with `prompt_lookup` N, its prompt lookup decoding (`prompt_lookup_num_tokens=N`), what a transformers user
    would turn on for speculation without a draft model."""

    PROMPT_LOOKUP_TOKENS = 10

    def __init__(self, model, eos_ids, prompt_lookup: int | None = None, assistant=None, assistant_name: str = ""):
        import torch

        self.torch = torch
        self.model = model
        self.eos_ids = sorted(eos_ids) or None
        self.prompt_lookup = prompt_lookup
        self.assistant = assistant  # a draft model: transformers' assisted generation
        self.label = "HF transformers" + (f" prompt lookup {prompt_lookup}" if prompt_lookup else "")
        if assistant is not None:
            self.label = f"HF transformers assisted generation ({assistant_name})"
        self.ngram = bool(prompt_lookup)

    @staticmethod
    def load_assistant(assistant_dir, target):
        """The draft model in `assistant_dir` for transformers' assisted generation (a mode's own draft format where
        one claims the directory, else any transformers model directory)."""
        from transformers import AutoModelForCausalLM

        from specbuild.modes.registry import load_object, modes

        if not Path(assistant_dir).is_dir():
            raise SpecbuildError(f"{assistant_dir}: --hf-assistant-dir does not exist")
        for spec in modes().values():
            if spec.hf_assistant:
                model = load_object(spec.hf_assistant)(Path(assistant_dir), target)
                if model is not None:
                    return model
        return AutoModelForCausalLM.from_pretrained(str(assistant_dir), dtype=target.dtype).eval()

    @staticmethod
    def load(model_dir, threads: int | None):
        import torch
        from transformers import AutoModelForCausalLM

        if threads:
            torch.set_num_threads(threads)
        if not Path(model_dir).is_dir():
            raise SpecbuildError(f"{model_dir}: --hf-model-dir does not exist")
        return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()

    def _generate(self, ids: list[int], max_new_tokens: int, sampling=None):
        torch = self.torch
        x = torch.tensor([ids], dtype=torch.long)
        extra = {"prompt_lookup_num_tokens": self.prompt_lookup} if self.prompt_lookup else {}
        if self.assistant is not None:
            extra["assistant_model"] = self.assistant
        if not decoding.is_greedy(sampling):
            torch.manual_seed(sampling.seed)
        with torch.inference_mode():
            start = time.perf_counter()
            out = self.model.generate(
                input_ids=x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=max_new_tokens,
                **decoding.hf_generate_kwargs(sampling),
                eos_token_id=self.eos_ids,
                pad_token_id=self.eos_ids[0] if self.eos_ids else None,
                **extra,
            )
            return time.perf_counter() - start, out[0, len(ids) :].tolist()

    def sample(self, ids: list[int], max_new_tokens: int, sampling=None) -> Sample:
        ttft, _ = self._generate(ids, 1, sampling)
        total, out = self._generate(ids, max_new_tokens, sampling)
        return Sample(output_ids=out, steps=0, accepted=0, total_s=total, ttft_s=ttft, decode_engine_s=0.0)


class HFBatch(StaticBatch):
    """transformers with a static batch, as a transformers user runs many prompts (`generate` on a left-padded
    batch, its documented way): the prompts left-padded with an attention mask and their own positions, one forward
    per token, fp32, on the same ids (--hf-model-dir)."""

    def __init__(self, model_dir, threads: int | None, max_new_tokens: int):
        import torch

        self.torch = torch
        self.model = HFTimer.load(model_dir, threads)
        eos = self.model.generation_config.eos_token_id
        super().__init__(set(eos if isinstance(eos, list) else [] if eos is None else [eos]), max_new_tokens)
        pad = self.model.generation_config.pad_token_id
        self.pad = int(pad if pad is not None else next(iter(sorted(self.eos)), 0))
        params = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.x
        self._last_logits = {"logits_to_keep": 1} if "logits_to_keep" in params else {}  # as generate's prefill
        self.label = f"HF transformers static batch {Path(model_dir).name}"
        self._state: dict | None = None

    def _start(self, requests: list[dict]) -> None:
        if not requests:
            self._state = None
            return
        torch = self.torch
        longest = max(len(r["ids"]) for r in requests)
        tokens = torch.full((len(requests), longest), self.pad, dtype=torch.long)
        mask = torch.zeros((len(requests), longest), dtype=torch.long)
        for row, request in enumerate(requests):  # left padding: every prompt ends at the last column
            tokens[row, longest - len(request["ids"]) :] = torch.tensor(request["ids"])
            mask[row, longest - len(request["ids"]) :] = 1
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        self._state = {"tokens": tokens, "mask": mask, "positions": positions, "cache": None}
        self._state["pick"] = decoding.hf_sampler(requests[0]["sampling"])

    def _next(self) -> list[int]:
        torch, state = self.torch, self._state
        with torch.inference_mode():
            out = self.model(
                input_ids=state["tokens"],  # [B, L] the padded prompts, then [B, 1] each step's tokens
                attention_mask=state["mask"],  # [B, past + L]
                position_ids=state["positions"],  # [B, L]
                use_cache=True,
                **{self._cache_arg: state["cache"]},
                **self._last_logits,
            )
        tokens = state["pick"](out.logits[:, -1])  # [B]
        state["cache"] = getattr(out, self._cache_arg)
        state["tokens"] = tokens.unsqueeze(1)
        state["positions"] = state["positions"][:, -1:] + 1
        state["mask"] = torch.cat([state["mask"], torch.ones_like(state["tokens"])], dim=1)
        return tokens.tolist()


class TransformersStack(PeerStack):
    name = "transformers"
    extra = "build"
    options = (
        PeerOption(
            "--hf-model-dir",
            "hf_model_dir",
            "Also time transformers' generate (with --concurrency, a static batch of the requests waiting).",
            multiple=False,
        ),
        PeerOption(
            "--hf-assistant-dir",
            "hf_assistant_dir",
            "With --hf-model-dir: also time transformers' assisted generation with this draft model (e.g. the draft "
            "shipped for SmolLM2, specbuild/data/heads/smollm2-draft).",
            multiple=False,
        ),
    )

    def check(self, args: dict, under_load: bool) -> None:
        if args.get("hf_assistant_dir") and not args.get("hf_model_dir"):
            raise SpecbuildError("--hf-assistant-dir drafts for transformers' generate: give --hf-model-dir too")
        if under_load and args.get("hf_assistant_dir"):
            raise SpecbuildError(
                "--concurrency runs the load benchmark: --hf-assistant-dir belongs to the one-at-a-time benchmark "
                "(run it without --concurrency)"
            )

    def sequential(self, args: dict, threads: int | None, eos_ids: set[int]) -> list:
        if not args.get("hf_model_dir"):
            return []
        model = HFTimer.load(args["hf_model_dir"], threads)
        timers = [HFTimer(model, eos_ids, n) for n in (None, HFTimer.PROMPT_LOOKUP_TOKENS)]
        if args.get("hf_assistant_dir"):
            assistant_dir = args["hf_assistant_dir"]
            assistant = HFTimer.load_assistant(assistant_dir, model)
            timers.append(HFTimer(model, eos_ids, assistant=assistant, assistant_name=Path(assistant_dir).name))
        return timers

    def load(self, args: dict, threads: int | None, max_num_seqs: int, max_new_tokens: int) -> list:
        return [HFBatch(args["hf_model_dir"], threads, max_new_tokens)] if args.get("hf_model_dir") else []


STACK = TransformersStack()
