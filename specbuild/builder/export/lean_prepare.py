"""The ONNX exporter's preparation of a program (decomposition, type promotion) made from what the traced program
already shows, instead of tracing it again.

torch.onnx.export takes torch.export's program (the training IR) and traces all of it again to decompose it to the
operators ONNX implements (`ExportedProgram.run_decompositions`, with fake tensors and symbolic shapes: about half of
an export), then interprets it once more, node by node, to insert casts where an op's inputs differ in dtype.

Decomposition: for specbuild's step graphs the program already holds only operators the exporter has ONNX functions
for, but for a few that decompose one to one: `a & b` and `a | b` (bitwise_and, bitwise_or), `1 - x` (a Sub of the
scalar and x), `x.to(dtype)` (a copy to that dtype; x itself where it has that dtype already and is not an output).
The assertions torch.export leaves are dropped by the exporter either way. `decomposed_in_place` makes those
renamings where the program shows it can: every call is an ATen op ONNX implements and that writes to nothing, one
of the renamings, an assertion, a cond, a tuple element or arithmetic on sizes. Anything else (an op without an ONNX
function, an in-place op, another higher-order op, an argument the renamings do not cover) leaves the program to
torch's own decomposition. The graph differs from the traced one only where an op the trace would have decomposed
has an ONNX function of its own (a narrow: a Slice whose end is an Add, where the trace wrote the end as a size
expression); what it computes is the same (tests/builder/export/test_lean_prepare.py, and every build's validation
against torch).

Type promotion: `promoted_in_place` runs torch's own pass, but takes each node's value from the program where the
pass leaves the node as it was (the same casts: tested).

`lean_preparation()` puts both in place of torch's for the time of one export; a torch without the private functions
they replace exports as it is (only slower).
"""

from __future__ import annotations

import contextlib
import operator

import torch

_ATEN = torch.ops.aten
_RENAMED = {_ATEN.__and__.Tensor: _ATEN.bitwise_and.Tensor, _ATEN.__or__.Tensor: _ATEN.bitwise_or.Tensor}
_ASSERTIONS = {
    _ATEN._assert_scalar.default,
    _ATEN._assert_tensor_metadata.default,
    _ATEN.sym_constrain_range_for_size.default,
}
# arithmetic on symbolic sizes (as Python's operator module's): no tensor in or out
_SYMBOLIC = {getattr(torch, f"sym_{n}", None) for n in ("not", "sum", "max", "min", "float", "int", "ite")} - {None}
_SIZE_MODULES = ("_operator", "math")


def decomposed_in_place(program, implemented: set) -> bool:
    """Decompose `program` (an ExportedProgram, every graph of it) in place where it holds only operators in
    `implemented` and the one-to-one renamings; return False, having changed nothing, where it holds anything else."""
    graphs = [m for m in program.graph_module.modules() if isinstance(m, torch.fx.GraphModule)]
    nodes = [n for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
    if not all(_covered(n, implemented) for n in nodes):
        return False
    for node in nodes:
        _rename(node)
    for gm in graphs:
        gm.recompile()
    return True


def _covered(node, implemented: set) -> bool:
    target = node.target
    if target in _RENAMED or target in _ASSERTIONS:
        return True
    if target is _ATEN.rsub.Scalar:
        return len(node.args) == 2 and node.kwargs.get("alpha", 1) == 1
    if target is _ATEN.to.dtype:  # (x, dtype): no copy=, memory_format= or non_blocking= to keep
        return len(node.args) == 2 and not node.kwargs and isinstance(node.args[0].meta.get("val"), torch.Tensor)
    if isinstance(target, torch._ops.OpOverload):
        return target in implemented and not target._schema.is_mutable
    if isinstance(target, torch._ops.HigherOrderOperator):
        return target is torch.ops.higher_order.cond
    return target is operator.getitem or target in _SYMBOLIC or getattr(target, "__module__", None) in _SIZE_MODULES


def _rename(node) -> None:
    """One node as torch's decomposition writes it (its value, meta['val'], is the same)."""
    target = node.target
    if target in _RENAMED:
        node.target = _RENAMED[target]
    elif target is _ATEN.rsub.Scalar:  # rsub(x, s) = s - x
        x, scalar = node.args
        node.target, node.args = _ATEN.sub.Tensor, (scalar, x)
    elif target is _ATEN.to.dtype:
        x, dtype = node.args
        if x.meta["val"].dtype == dtype and all(user.op != "output" for user in node.users):  # x itself
            node.replace_all_uses_with(x)
            node.graph.erase_node(node)
        else:  # a copy (to its own dtype where the program's signature names the node as an output)
            node.target, node.args, node.kwargs = _ATEN._to_copy.default, (x,), {"dtype": dtype}


def promoted_in_place(graph_module) -> None:
    """The exporter's type promotion pass (explicit casts where an op's inputs differ in dtype) over every graph of
    `graph_module`, each node's value taken from the program (meta["val"]) instead of being computed again, but where
    the pass changed the node (it computes that one, as the pass does)."""
    from torch.onnx._internal.fx import passes
    from torch.onnx._internal.fx.passes import type_promotion

    class KnownValues(type_promotion._TypePromotionInterpreter):
        def run_node(self, node):
            self.changed = False
            with self._set_current_node(node):
                if rule := type_promotion.get_type_promotion_rule(node, self.type_promotion_table):
                    self._maybe_promote_node(node, rule)
            value = node.meta.get("val")
            if node.op == "call_function" and not self.changed and value is not None:
                return value
            return torch.fx.Interpreter.run_node(self, node)

        def _rerun_node_after_type_promotion(self, node, expected_out_dtype):
            self.changed = True
            return super()._rerun_node_after_type_promotion(node, expected_out_dtype)

    for module in graph_module.modules():
        transform = passes.InsertTypePromotion(module)
        transform.interpreter = KnownValues(module, transform.interpreter.type_promotion_table)
        transform.run()


@contextlib.contextmanager
def lean_preparation():
    """For the time of one export: the exporter's decomposition made in place where decomposed_in_place can (its own
    trace otherwise), and its type promotion pass run with the values the program holds (promoted_in_place)."""
    try:
        from torch.onnx._internal.exporter import _decomp, _fx_passes
        from torch.onnx._internal.fx.passes import type_promotion
    except ImportError:
        yield
        return
    names = ("decompose_with_registry", "insert_type_promotion_nodes")
    originals = {name: getattr(_fx_passes, name, None) for name in names}
    used = [getattr(type_promotion, n, None) for n in ("_TypePromotionInterpreter", "get_type_promotion_rule")]
    if None in [*originals.values(), *used]:
        yield
        return

    def decompose(program, registry):
        if decomposed_in_place(program, set(_decomp.get_onnx_implemented_overloads(registry))):
            return program
        return originals["decompose_with_registry"](program, registry)

    _fx_passes.decompose_with_registry = decompose
    _fx_passes.insert_type_promotion_nodes = promoted_in_place
    try:
        yield
    finally:
        for name, function in originals.items():
            setattr(_fx_passes, name, function)
