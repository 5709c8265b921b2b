"""The one draft-tree normal form shared by every speculative mode (numpy only; the runtime imports it).

A tree is a tuple of *choices*, one per non-root node: the top-k rank picked at each depth from the root
(Medusa's ``medusa_choices`` convention). Node 0 is the root (the last accepted token); node ``i >= 1`` is
``choices[i - 1]``. Nodes are sorted by ``(len, choice)`` like Medusa's ``generate_medusa_buffers``, so every
node's ancestors come before it and any prefix of the node list is itself a valid tree.

Medusa choice lists (full or paths-only form), EAGLE-1 static trees and the presets in
``specbuild/data/trees.yaml`` all parse into :class:`Tree`; its derived arrays (parents, depths, ancestor
mask, root-to-leaf paths) are what the builder bakes into graphs and the runtime feeds to engines.
"""

from __future__ import annotations

import json
import numbers
from dataclasses import dataclass
from functools import cached_property
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from specbuild.errors import SpecbuildError

Choice = tuple[int, ...]

# Build-time bounds shared by every mode: nodes one step verifies (root included) -- far beyond what pays on any
# device -- and ranks drawn from one distribution (TensorRT's TopK takes K <= 3840).
MAX_TREE_SIZE = 512
MAX_TOP_K = 3839

_PRESETS_FILE = "trees.yaml"
_FILE_KEYS = ("choices", "medusa_choices")


def _fmt(choice: Choice) -> str:
    return str(list(choice))


def _readonly(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


def _as_choice(entry: Any, source: str) -> Choice:
    """One validated choice: a non-empty sequence of non-negative ints."""
    if isinstance(entry, (str, bytes)) or not hasattr(entry, "__iter__"):
        raise SpecbuildError(f"{source} choice {entry!r} is not a list of top-k indices")
    items = list(entry)
    if not items:
        raise SpecbuildError(f"{source} has an empty choice []; every choice names at least one top-k index")
    out = []
    for item in items:
        if isinstance(item, bool) or not isinstance(item, numbers.Integral):
            raise SpecbuildError(f"{source} choice {items!r} holds {item!r}, which is not an integer top-k index")
        if item < 0:
            raise SpecbuildError(f"{source} choice {items!r} holds negative top-k index {int(item)}")
        out.append(int(item))
    return tuple(out)


def _normalize(choices: Any, source: str = "tree") -> tuple[Choice, ...]:
    """Validate choices in full (prefix-closed) or paths-only (leaves only) form and return the sorted full form."""
    if isinstance(choices, (str, bytes, dict)) or not hasattr(choices, "__iter__"):
        raise SpecbuildError(f"{source} must be a list of choices such as [[0], [1], [0, 0]], got {choices!r}")
    parsed = [_as_choice(entry, source) for entry in choices]
    seen: set[Choice] = set()
    for choice in parsed:
        if choice in seen:
            raise SpecbuildError(f"{source} lists choice {_fmt(choice)} more than once")
        seen.add(choice)
    has_strict_prefix = any(choice[:k] in seen for choice in parsed for k in range(1, len(choice)))
    if not has_strict_prefix:
        # Paths-only form: every entry is a leaf; expand to the prefix closure.
        closure = {choice[:k] for choice in parsed for k in range(1, len(choice) + 1)}
        return tuple(sorted(closure, key=lambda c: (len(c), c)))
    ordered = sorted(parsed, key=lambda c: (len(c), c))
    for choice in ordered:
        if len(choice) > 1 and choice[:-1] not in seen:
            raise SpecbuildError(f"{source} choice {_fmt(choice)} lacks its prefix {_fmt(choice[:-1])}")
    return tuple(ordered)


@dataclass(frozen=True)
class Tree:
    """A draft tree in normal form; build it with :meth:`from_choices`, :meth:`chain` or :func:`parse_tree`."""

    choices: tuple[Choice, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "choices", _normalize(self.choices))

    # ----------------------------------------------------------------------------------------- constructors
    @classmethod
    def from_choices(cls, choices: Any, *, source: str = "tree") -> Tree:
        """Accept Medusa-style choices in full (prefix-closed) or paths-only (leaves only) form."""
        return cls(_normalize(choices, source))

    @classmethod
    def chain(cls, depth: int) -> Tree:
        """A single chain of ``depth`` draft tokens: (0,), (0, 0), ..."""
        if isinstance(depth, bool) or not isinstance(depth, numbers.Integral) or depth < 0:
            raise SpecbuildError(f"chain depth must be a non-negative integer, got {depth!r}")
        return cls(tuple((0,) * k for k in range(1, int(depth) + 1)))

    # ------------------------------------------------------------------------------------------- structure
    @property
    def size(self) -> int:
        """Number of nodes including the root."""
        return len(self.choices) + 1

    @property
    def num_draft(self) -> int:
        """Number of draft (non-root) nodes."""
        return len(self.choices)

    @property
    def depth(self) -> int:
        """Maximum choice length (0 for a root-only tree)."""
        return max((len(c) for c in self.choices), default=0)

    @property
    def is_chain(self) -> bool:
        """One node per depth: node i's parent is node i - 1 (a root-only tree is a chain)."""
        return self.depth == self.num_draft

    @cached_property
    def _index(self) -> dict[Choice, int]:
        index: dict[Choice, int] = {(): 0}
        for i, choice in enumerate(self.choices, start=1):
            index[choice] = i
        return index

    def node_index(self, choice) -> int:
        """The node index of `choice` (a tuple of ranks; () is the root)."""
        return self._index[tuple(choice)]

    @cached_property
    def parents(self) -> np.ndarray:
        """int64 [N]: parent node index of each node; the root's is -1."""
        out = np.full(self.size, -1, dtype=np.int64)
        for i, choice in enumerate(self.choices, start=1):
            out[i] = self._index[choice[:-1]]
        return _readonly(out)

    @cached_property
    def depths(self) -> np.ndarray:
        """int64 [N]: depth of each node (= its position offset from the root); root 0."""
        return _readonly(np.array([0] + [len(c) for c in self.choices], dtype=np.int64))

    @cached_property
    def ranks(self) -> np.ndarray:
        """int64 [N]: top-k rank of each node among its depth's candidates; root 0."""
        return _readonly(np.array([0] + [c[-1] for c in self.choices], dtype=np.int64))

    @cached_property
    def ancestor_mask(self) -> np.ndarray:
        """bool [N, N]: ``mask[i, j]`` is True when node i may attend to node j (j is i or an ancestor of i)."""
        n = self.size
        mask = np.zeros((n, n), dtype=bool)
        parents = self.parents
        for i in range(n):
            mask[i, i] = True
            p = int(parents[i])
            if p >= 0:
                mask[i] |= mask[p]  # parents precede children, so the parent's row is complete
        return _readonly(mask)

    @cached_property
    def is_leaf(self) -> np.ndarray:
        """bool [N]: True for nodes without children (the root only when the tree is empty)."""
        leaf = np.ones(self.size, dtype=bool)
        leaf[self.parents[self.parents >= 0]] = False
        return _readonly(leaf)

    @cached_property
    def paths(self) -> np.ndarray:
        """int64 [NP, depth+1]: root-to-leaf node indices, one row per leaf in node order, -1 padded."""
        leaves = np.flatnonzero(self.is_leaf)
        out = np.full((len(leaves), self.depth + 1), -1, dtype=np.int64)
        parents = self.parents
        for row, leaf in enumerate(leaves):
            chain = []
            node = int(leaf)
            while node >= 0:
                chain.append(node)
                node = int(parents[node])
            out[row, : len(chain)] = chain[::-1]
        return _readonly(out)

    @property
    def max_top_k(self) -> int:
        """Largest rank used anywhere plus one (0 for a root-only tree)."""
        return max((max(c) + 1 for c in self.choices), default=0)

    @property
    def top_k_per_depth(self) -> list[int]:
        """For depths 1..depth: the largest rank used at that depth plus one."""
        out = [0] * self.depth
        for choice in self.choices:
            d = len(choice) - 1
            out[d] = max(out[d], choice[-1] + 1)
        return out

    # ------------------------------------------------------------------------------------------ validation
    def check(
        self,
        *,
        top_k: int | None = None,
        max_depth: int | None = None,
        max_draft_len: int | None = None,
        max_size: int | None = MAX_TREE_SIZE,
        source: str = "tree",
        depth_limit_name: str | None = None,
    ) -> None:
        """Raise SpecbuildError naming the offending value if the tree exceeds a build-time limit.

        ``depth_limit_name`` phrases the depth limit, e.g. "Medusa heads" gives
        "tree depth 6 exceeds the 5 Medusa heads (choice [...])".
        """
        if top_k is not None:
            for choice in self.choices:
                for rank in choice:
                    if rank >= top_k:
                        raise SpecbuildError(
                            f"{source} choice {_fmt(choice)} uses top-k index {rank} but the build's top-k is {top_k}"
                        )
        if max_depth is not None and self.depth > max_depth:
            deepest = next(c for c in self.choices if len(c) == self.depth)
            limit = f"the {max_depth} {depth_limit_name}" if depth_limit_name else f"the maximum depth {max_depth}"
            raise SpecbuildError(f"{source} depth {self.depth} exceeds {limit} (choice {_fmt(deepest)})")
        if max_draft_len is not None and self.num_draft > max_draft_len:
            raise SpecbuildError(f"{source} has {self.num_draft} draft nodes but --max-draft-len is {max_draft_len}")
        if max_size is not None and self.size > max_size:
            raise SpecbuildError(f"{source} has {self.size} nodes; at most {max_size} are supported per step")

    # ------------------------------------------------------------------------------------------ transforms
    def truncated(self, max_nodes: int) -> Tree:
        """The first ``max_nodes`` draft nodes in node order (prefix-closed thanks to the sort order)."""
        if isinstance(max_nodes, bool) or not isinstance(max_nodes, numbers.Integral) or max_nodes < 0:
            raise SpecbuildError(f"tree truncation size must be a non-negative integer, got {max_nodes!r}")
        return Tree(self.choices[: int(max_nodes)])

    def to_list(self) -> list[list[int]]:
        return [list(c) for c in self.choices]


# ------------------------------------------------------------------------------------------------- presets
_presets_cache: dict[str, dict[str, Any]] | None = None


def _load_presets() -> dict[str, dict[str, Any]]:
    global _presets_cache
    if _presets_cache is None:
        import yaml

        text = resources.files("specbuild").joinpath("data", _PRESETS_FILE).read_text(encoding="utf-8")
        data = yaml.safe_load(text)
        _presets_cache = dict(data["presets"])
    return _presets_cache


def preset_names() -> list[str]:
    """Names of the tree presets shipped in specbuild/data/trees.yaml."""
    return sorted(_load_presets())


def preset_info(name: str) -> dict[str, Any]:
    """The preset's metadata (source, method, notes) as written in trees.yaml."""
    presets = _load_presets()
    if name not in presets:
        raise SpecbuildError(f"unknown tree preset {name!r}; available: {', '.join(preset_names())}")
    return dict(presets[name])


def _preset_choices(name: str) -> list:
    entry = preset_info(name)
    if "choices" in entry:
        return entry["choices"]
    derive = entry["derive"]  # first N entries of another preset's list in its published order
    return _preset_choices(derive["from"])[: int(derive["first"])]


def preset(name: str) -> Tree:
    """The named preset as a Tree."""
    return Tree.from_choices(_preset_choices(name), source=f"tree preset {name!r}")


# ------------------------------------------------------------------------------------------------- parsing
def _from_loaded(data: Any, source: str) -> Tree:
    if isinstance(data, dict):
        for key in _FILE_KEYS:
            if key in data:
                return Tree.from_choices(data[key], source=source)
        raise SpecbuildError(f"{source} is a mapping without a 'choices' or 'medusa_choices' key")
    if isinstance(data, list):
        return Tree.from_choices(data, source=source)
    raise SpecbuildError(f"{source} must hold a list of choices such as [[0], [1], [0, 0]]")


def _load_file(path: Path) -> Tree:
    source = f"tree file {str(path)!r}"
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecbuildError(f"cannot read tree file {str(path)!r}: {exc}") from None
    if path.suffix.lower() in (".yaml", ".yml"):
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise SpecbuildError(f"tree file {str(path)!r} is not valid YAML: {exc}") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SpecbuildError(f"tree file {str(path)!r} is not valid JSON: {exc}") from None
    return _from_loaded(data, source)


def parse_tree(spec: str | list | tuple | Tree) -> Tree:
    """A preset name, JSON text ("[[0],[1],[0,0]]"), a .json/.yaml file path, a list of choices, or a Tree."""
    if isinstance(spec, Tree):
        return spec
    if isinstance(spec, Path):
        return _load_file(spec)
    if isinstance(spec, (list, tuple)):
        return Tree.from_choices(spec)
    if not isinstance(spec, str):
        raise SpecbuildError(f"tree spec must be a preset name, JSON text or a file path, got {spec!r}")
    text = spec.strip()
    if not text:
        raise SpecbuildError(f"empty tree spec; use a preset name ({', '.join(preset_names())}) or JSON choices")
    if text in _load_presets():
        return preset(text)
    if text[0] in "[{":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SpecbuildError(f"tree spec {text!r} is not valid JSON: {exc}") from None
        return _from_loaded(data, "tree spec")
    path = Path(text).expanduser()
    if path.suffix.lower() in (".json", ".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise SpecbuildError(f"cannot read tree file {text!r}: no such file")
        return _load_file(path)
    raise SpecbuildError(f"unknown tree preset {text!r}; available: {', '.join(preset_names())}")
