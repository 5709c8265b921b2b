"""Export of torch.cond (an ONNX If) without tracing a branch again to learn what its graph already shows.

Each pass of the ONNX exporter over a program (torch.export's trace, then the decomposition to core ATen)
functionalizes every cond, and each time it traces both branches twice more before tracing them for real: once to
make the operator's schema (asked only whether a branch mutates an input) and once to check that no branch aliases or
mutates an input. At that point each branch is already an fx graph, and for the branches specbuild writes
(acceptance.branch: operands copied, outputs cloned, nothing written in place) the graph shows the answer: no node
writes to a tensor and every output is a distinct tensor that an op without aliasing made. For an EAGLE-3 step (an If
whose drafting branch holds ~850 nodes) they were ~11 s of a 57 s build of SmolLM2 (now 45 s); a small tree saves
less (1B, 8 nodes: 0.5 s of 86 s in float, 6 s of 136 s quantized, which traces twice).

`lean_cond_passes()` answers both questions from the graph for the time of one export when it can, and asks torch's
own (tracing) check otherwise: a branch with any in-place op, any op torch does not describe, or an output that is an
input or a view is checked as before, so a branch that mutates its input is still refused
(tests/builder/test_cond_export.py). The exported graph is the same, but for the names the exporter gives a few size
values (it numbers symbols as it traces, and traces less). It replaces two private torch functions while it is
active; a torch without them exports as it is (only slower).
"""

from __future__ import annotations

import contextlib
import operator
from types import SimpleNamespace

import torch

_NOT_MUTABLE = SimpleNamespace(is_mutable=False)  # all auto-functionalization asks of a cond's schema
# arithmetic on symbolic sizes (as Python's operator module's): no tensor in or out
_SYMBOLIC = {getattr(torch, f"sym_{n}", None) for n in ("not", "sum", "max", "min", "float", "int", "ite")} - {None}


def plainly_functional(graph_module, cond) -> bool:
    """True when the graph can neither mutate nor alias its inputs: every call is an ATen op whose schema neither
    writes nor (for an output) returns a view, a nested `cond` (checked on its own), an element of a tuple, or
    arithmetic on sizes; every output is a distinct tensor made by such a non-view op."""
    fresh = set()
    for node in graph_module.graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            continue
        if node.op == "output":
            outs = [o for o in torch.utils._pytree.tree_leaves(node.args) if o is not None]
            return all(o in fresh for o in outs) and len(set(outs)) == len(outs)
        if node.op != "call_function":
            return False
        target = node.target
        if isinstance(target, torch._ops.OpOverload):
            schema = target._schema
            if schema.is_mutable:
                return False
            if not any(r.alias_info is not None for r in schema.returns):
                fresh.add(node)
        elif target is cond:
            fresh.add(node)
        elif target is operator.getitem:  # an element of a tuple: fresh when the tuple is (topk's, not split's)
            if node.args[0] in fresh:
                fresh.add(node)
        elif target not in _SYMBOLIC and getattr(target, "__module__", None) not in ("_operator", "operator", "math"):
            return False
    return False


@contextlib.contextmanager
def lean_cond_passes():
    """While active, a cond whose branch graphs are plainly functional gets no schema traced and no tracing check."""
    try:
        from torch._higher_order_ops import utils as hop_utils
        from torch._higher_order_ops.cond import cond_op

        check = hop_utils._check_alias_and_mutation
        schema = cond_op.gen_schema
        own = vars(cond_op).get("gen_schema")  # an instance attribute of the operator to put back, if any
    except (ImportError, AttributeError):  # another torch: export as it is
        yield
        return

    def plain(*branches) -> bool:
        return all(isinstance(b, torch.fx.GraphModule) and plainly_functional(b, cond_op) for b in branches)

    def gen_schema(pred, true_fn, false_fn, operands):
        return _NOT_MUTABLE if plain(true_fn, false_fn) else schema(pred, true_fn, false_fn, operands)

    def check_alias_and_mutation(graph_module, inputs_fake, name, pre_dispatch):
        if name in ("cond_true", "cond_false") and plain(graph_module):
            return None
        return check(graph_module, inputs_fake, name, pre_dispatch)

    cond_op.gen_schema = gen_schema
    hop_utils._check_alias_and_mutation = check_alias_and_mutation
    try:
        yield
    finally:
        hop_utils._check_alias_and_mutation = check
        if own is None:
            del cond_op.gen_schema  # the class's method again
        else:
            cond_op.gen_schema = own
