"""Export of torch.cond (an ONNX If) without tracing a branch again to learn what its graph already shows.

Each pass of the ONNX exporter over a program (torch.export's trace, then the decomposition to core ATen)
functionalizes every cond, and each time it traces both branches twice more before tracing them for real: once to
make the operator's schema (asked only whether a branch mutates an input) and once to check that no branch aliases or
mutates an input. At that point each branch is already an fx graph, and for the branches specbuild writes
(acceptance.branch: operands copied, outputs cloned, nothing written in place) the graph shows the answer: no node
writes to a tensor and every output is a distinct tensor that an op without aliasing made. For an EAGLE-3 step (an If
whose drafting branch holds ~850 nodes) they were a fifth of a SmolLM2 build; a small tree saves less
(docs/benchmarks/design-measurements.md).

After tracing both branches, torch's tracer also runs the cond once more on fake tensors to learn its outputs' shapes:
it interprets both branch graphs node by node again (a nested cond's inside it once more for each level), though
each graph's output nodes already hold those fake tensors, made from the same operands (an eighth of an `eagle3`
export, measured in the same page): `lean_cond_passes()`
takes the outputs from the graphs (merged as torch merges them) where the graph was traced from tensors like the
operands given (the same dtype, sizes and strides), and runs the graphs otherwise.

`lean_cond_passes()` answers the questions from the graph for the time of one export when it can, and asks torch's
own (tracing) check otherwise: a branch with any in-place op, any op torch does not describe, or an output that is an
input or a view is checked as before, so a branch that mutates its input is still refused
(tests/builder/export/test_cond_export.py). The exported graph is the same, but for the names the exporter gives a few
size values (it numbers symbols as it traces, and traces less). It replaces two private torch functions and the cond
operator's fake-tensor kernel while it is active; a torch without them exports as it is (only slower).
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


def traced_outputs(graph_module, operands, mode):
    """The fake outputs of a branch graph traced from `operands` under fake `mode`, as running it again would give:
    (flat outputs, their tree spec), or None where the graph does not show them (it was traced from tensors unlike
    `operands`, an output has no fake value of this mode or a data-dependent size, the graph restructures its
    output)."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    if not isinstance(graph_module, torch.fx.GraphModule):
        return None
    if type(graph_module.graph._codegen) is not torch.fx.graph.CodeGen:  # a pytree codegen reshapes the output
        return None
    nodes = graph_module.graph.nodes
    inputs = [n.meta.get("val") for n in nodes if n.op == "placeholder"]
    if len(inputs) != len(operands) or not all(_same_meta(v, o) for v, o in zip(inputs, operands)):
        return None
    result = next(n for n in reversed(nodes) if n.op == "output").args[0]
    values = torch.fx.node.map_arg(result, lambda n: n.meta.get("val"))
    flat, spec = torch.utils._pytree.tree_flatten(values)
    if not all(v is None or type(v) is int or (type(v) is FakeTensor and v.fake_mode is mode) for v in flat):
        return None
    if any(free_unbacked_symbols(v) for v in flat if v is not None):  # data-dependent sizes: a fresh run's own
        return None
    return flat, spec


def _same_meta(traced, given) -> bool:
    """True when the fake tensor a graph was traced from has the same dtype, device, sizes and strides (the same
    symbolic expressions, compared without a guard) as the tensor given now."""
    if not (isinstance(traced, torch.Tensor) and isinstance(given, torch.Tensor)):
        return traced is given
    if (traced.dtype, traced.device, traced.dim()) != (given.dtype, given.device, given.dim()):
        return False
    return _exprs(traced.shape) == _exprs(given.shape) and _exprs(traced.stride()) == _exprs(given.stride())


def _exprs(sizes) -> tuple:
    return tuple(s.node.expr if isinstance(s, torch.SymInt) else int(s) for s in sizes)


@contextlib.contextmanager
def lean_cond_passes():
    """While active, a cond whose branch graphs are plainly functional gets no schema traced and no tracing check,
    and a cond's fake outputs are read from its traced branch graphs where they show them."""
    try:
        from torch._higher_order_ops import utils as hop_utils
        from torch._higher_order_ops.cond import _merge_output, cond_op
        from torch._subclasses.fake_tensor import FakeTensorMode

        check = hop_utils._check_alias_and_mutation
        schema = cond_op.gen_schema
        own = vars(cond_op).get("gen_schema")  # an instance attribute of the operator to put back, if any
        fake_kernel = cond_op.python_key_table[FakeTensorMode]
    except (ImportError, AttributeError, KeyError):  # another torch: export as it is
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

    def fake_cond(mode, pred, true_fn, false_fn, operands):
        shown = [traced_outputs(fn, operands, mode) for fn in (true_fn, false_fn)]
        if None in shown or shown[0][1] != shown[1][1]:  # one tree spec: as many outputs
            return fake_kernel(mode, pred, true_fn, false_fn, operands)
        (true_outs, spec), (false_outs, _) = shown
        with mode:
            merged = [_merge_output(a, b, mode) for a, b in zip(true_outs, false_outs)]
        return torch.utils._pytree.tree_unflatten(merged, spec)

    cond_op.gen_schema = gen_schema
    hop_utils._check_alias_and_mutation = check_alias_and_mutation
    cond_op.python_key_table[FakeTensorMode] = fake_cond
    try:
        yield
    finally:
        cond_op.python_key_table[FakeTensorMode] = fake_kernel
        hop_utils._check_alias_and_mutation = check
        if own is None:
            del cond_op.gen_schema  # the class's method again
        else:
            cond_op.gen_schema = own
