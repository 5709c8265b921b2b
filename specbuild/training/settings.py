"""What every head trainer shares (`TrainSettings`), and the one place a recipe's `train:` mapping is read into it
and into a trainer's own knobs (`read_train`, `TrainSettings.from_recipe`)."""

from __future__ import annotations

import dataclasses
import time
import types
import typing

T = typing.TypeVar("T")


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """The knobs every trainer reads, under `train:` keys of the same names (a trainer may map a field to a key of
    its own). Each trainer module's `SETTINGS` holds its defaults: they differ between trainers (lr, batch, warm-up,
    epochs, logging, draft vocabulary), so none are given here but those all of them share."""

    epochs: float  # passes over the training split (the time budget may end training first)
    lr: float  # the peak learning rate (AdamW)
    batch: int  # per optimizer step, in the trainer's unit: rows (Medusa, ReDrafter), chunks (EAGLE), padded tokens
    warmup: int  # linear warm-up steps (Medusa, ReDrafter and the draft model: at most a tenth of the steps)
    time_budget_s: float  # the loop's time budget (see loop_budget)
    heldout_frac: float = 0.05  # the held-out split (heldout.heldout_mask)
    seed: int = 0
    log_every: int = 50  # a progress line every this many optimizer steps
    draft_vocab_size: int | None = None  # the draft vocabulary's cap (vocab.frequent_targets); None: no cap
    init_from: str | None = None  # a head directory the trainer wrote before: training continues from it
    end_by: float | None = None  # a Unix time the run must end by (set by callers such as train-heads.sh)
    end_reserve_s: float = 30.0  # kept before end_by for evaluation and export
    device: str = "cpu"  # cuda or cpu: the recipe's device, not a `train:` key

    def loop_budget(self) -> float:
        """The loop's time budget (s), read when the loop is about to start: `time_budget_s`, shortened so that the
        run ends by `end_by` less `end_reserve_s`; at least 1 s."""
        budget = float(self.time_budget_s)
        if self.end_by:
            budget = min(budget, float(self.end_by) - time.time() - float(self.end_reserve_s))
        return max(budget, 1.0)

    @classmethod
    def from_recipe(cls, cfg: dict, defaults: TrainSettings, keys: dict[str, str] | None = None) -> TrainSettings:
        """A trainer's `defaults` with what the recipe (`load_recipe`'s dict) sets under `train:` (see read_train),
        on the recipe's device."""
        from specbuild.training.distill import default_device

        return dataclasses.replace(read_train(cfg, defaults, keys), device=cfg.get("device") or default_device())


def read_train(cfg: dict, defaults: T, keys: dict[str, str] | None = None) -> T:
    """`defaults` (a dataclass: TrainSettings or a trainer's own knobs) with each field the recipe's `train:` mapping
    sets, under the field's name or the key `keys` gives for it, converted to the field's type; a value that does
    not convert raises an error naming the recipe and the key. Keys no field reads are left to the trainer."""
    train, keys = cfg.get("train") or {}, keys or {}
    hints = typing.get_type_hints(type(defaults))
    values = {}
    for field in dataclasses.fields(defaults):
        key = keys.get(field.name, field.name)
        if key in train:
            values[field.name] = _convert(hints[field.name], train[key], cfg.get("recipe_path"), key)
    return dataclasses.replace(defaults, **values)


def _convert(hint, value, recipe: str | None, key: str):
    """`value` as the annotated type `hint`: int, float, bool, str, tuple[int, ...], or one of them | None."""
    kinds = [k for k in typing.get_args(hint) if k is not type(None)]
    optional = typing.get_origin(hint) in (typing.Union, types.UnionType)
    if optional and value is None:
        return None
    kind = kinds[0] if optional else hint
    try:
        if typing.get_origin(kind) is tuple:
            return tuple(typing.get_args(kind)[0](v) for v in value)
        return kind(value)
    except (TypeError, ValueError):
        from specbuild.errors import SpecbuildError

        name = getattr(typing.get_origin(kind), "__name__", None) or kind.__name__
        where = f"recipe {recipe}" if recipe else "recipe"
        raise SpecbuildError(f"{where}: train.{key} {value!r} is not a valid {name}") from None
