"""The one training loop of every head trainer: AdamW, a warm-up + cosine learning-rate schedule, a time budget.

A mode supplies its model, an iterator of batches, a loss function and a schedule; the loop owns the optimizer,
bf16 autocast on CUDA, gradient clipping, logging and the per-step losses it returns. Two schedules exist:
`FittedCosine` (Medusa, ReDrafter: the step count shrinks after a few steps to end inside the time budget) and
`ProgressCosine` (EAGLE: the cosine follows whichever of steps or time is further along, never below a floor).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterator

import torch


@dataclasses.dataclass
class FittedCosine:
    """Linear warm-up, cosine to zero over `total` steps; after `fit_at` steps the total shrinks so that the
    schedule ends inside `time_budget_s`; training stops at 1.1 times the budget in any case."""

    lr: float
    total: int
    warmup: int
    time_budget_s: float
    fit_at: int = 20

    def lr_at(self, step: int, elapsed: float) -> float:
        warm = min(1.0, (step + 1) / max(1, self.warmup))
        return self.lr * warm * 0.5 * (1 + math.cos(math.pi * step / self.total))

    def done(self, step: int, elapsed: float, log) -> bool:
        if elapsed > 1.1 * self.time_budget_s:
            log(f"time budget reached at step {step}/{self.total}")
            return True
        return step >= self.total

    def after_step(self, step: int, elapsed: float, log) -> None:
        if step != self.fit_at:
            return
        fit = int(step * self.time_budget_s / max(1e-6, elapsed))
        if fit < self.total:
            log(f"schedule shortened to {fit} steps to fit the time budget")
            self.total = max(step + 1, fit)


@dataclasses.dataclass
class ProgressCosine:
    """Linear warm-up, cosine over the progress max(step / total, time / budget), at least `floor` times `lr`."""

    lr: float
    total: int
    warmup: int
    time_budget_s: float
    floor: float = 0.02

    def lr_at(self, step: int, elapsed: float) -> float:
        progress = min(1.0, max(step / self.total, elapsed / self.time_budget_s))
        sched = min(1.0, (step + 1) / max(1, self.warmup)) * 0.5 * (1 + math.cos(math.pi * progress))
        return self.lr * max(sched, self.floor)

    def done(self, step: int, elapsed: float, log) -> bool:
        return step >= self.total or elapsed > self.time_budget_s

    def after_step(self, step: int, elapsed: float, log) -> None:
        pass


@dataclasses.dataclass
class LoopResult:
    steps: int
    seconds: float
    losses: list[float]  # one per optimizer step


def train_loop(
    model: torch.nn.Module,
    batches: Iterator,
    loss_fn: Callable[[object], torch.Tensor],
    schedule: FittedCosine | ProgressCosine,
    device: str = "cpu",
    betas: tuple[float, float] = (0.9, 0.999),
    grad_clip: float | None = None,
    log_every: int = 50,
    note: Callable[[], str] | None = None,
    log=print,
    every: tuple[int, Callable[[int], None]] | None = None,
) -> LoopResult:
    """Optimise the trainable parameters of `model` (already on `device`) on `loss_fn(batch)` until the schedule
    is done or `batches` runs out. `note()` adds mode-specific facts to the progress lines; `every` = (n, fn) calls
    fn(step) after every n steps (e.g. a held-out evaluation per epoch)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=schedule.lr, betas=betas, weight_decay=0.0)
    autocast = torch.autocast(device_type="cuda", dtype=torch.bfloat16) if device == "cuda" else None
    losses: list[torch.Tensor] = []
    step, t0 = 0, time.time()
    while not schedule.done(step, time.time() - t0, log):
        batch = next(batches, None)
        if batch is None:
            break
        lr = schedule.lr_at(step, time.time() - t0)
        for group in opt.param_groups:
            group["lr"] = lr
        with autocast if autocast is not None else torch.enable_grad():
            loss = loss_fn(batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(params, grad_clip)
        opt.step()
        losses.append(loss.detach())
        step += 1
        schedule.after_step(step, time.time() - t0, log)
        if step % log_every == 0 or step == schedule.total:
            extra = f" {note()}" if note else ""
            log(f"step {step}/{schedule.total} loss {loss.item():.4f} lr {lr:.2e}{extra} {time.time() - t0:.0f}s")
        if every is not None and step % every[0] == 0:
            every[1](step)
    seconds = time.time() - t0
    return LoopResult(step, seconds, torch.stack(losses).float().cpu().tolist() if losses else [])


def row_batches(rows, batch: int, rng) -> Iterator[torch.Tensor]:
    """Endless batches of row indices: a fresh permutation (numpy Generator `rng`) whenever one runs out."""
    order, pos = rng.permutation(rows), 0
    while True:
        if pos + batch > len(order):
            order, pos = rng.permutation(rows), 0
        yield torch.from_numpy(order[pos : pos + batch])
        pos += batch


def epoch_batches(items: list, batch: int, rng) -> Iterator[list]:
    """Full batches of `items`, reshuffled (random.Random `rng`) every epoch; none when there are fewer than `batch`."""
    while len(items) >= batch:
        order = list(range(len(items)))
        rng.shuffle(order)
        for i in range(0, len(order) - batch + 1, batch):
            yield [items[k] for k in order[i : i + batch]]
