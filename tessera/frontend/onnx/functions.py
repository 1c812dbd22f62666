"""Ops imported from their ONNX function definitions.

Many ONNX ops are defined by a function: a body of simpler ONNX nodes (Selu, ReduceL2,
PRelu, MeanVarianceNormalization...), some of them context dependent -- built for the node's
attributes and input types (LayerNormalization, GroupNormalization, Attention,
RotaryEmbedding...).  For an op without a rule, or a node using an attribute its rule does
not handle, the importer imports the body instead, in a scope of its own: formal inputs are
bound to the node's values, internal names stay local (subgraphs of the body see them),
attribute references (`@alpha`) take the node's values or the schema's defaults, the body's
nodes are imported under the body's opset and its outputs bound to the node's.  A body
written for a later opset is used when the op did not change in between.
The result is a decomposition into ops tessera compiles (and fuses), not a fallback.
"""

from __future__ import annotations

from typing import Any

from tessera.errors import UnsupportedError
from tessera.frontend.onnx.importer import Importer, Known, function_expander
from tessera.graph import Tensor
from tessera.ir import dtypes


def function_body(im: Importer, node: Any, opset: int) -> Any | None:
    """The FunctionProto defining node at opset, or None when its schema defines none."""
    import onnx

    try:
        schema = onnx.defs.get_schema(node.op_type, opset, "")
    except onnx.defs.SchemaError:
        return None
    # The schema's function for this opset is its latest body of an opset <= ours (as onnx's
    # inliner picks it); a body only written for later opsets still defines this node when the
    # op itself did not change in between (the same schema version).
    def usable(versions):
        older = [v for v in versions if v <= opset]
        if older:
            return max(older)
        same = [v for v in versions if _since(node.op_type, v) == schema.since_version]
        return min(same) if same else None

    if schema.has_function:
        v = usable(schema.function_opset_versions)
        if v is None:
            return None
        raw = schema.get_function_with_opset_version(v)
    elif schema.has_context_dependent_function:
        v = usable(schema.context_dependent_function_opset_versions)
        if v is None:
            return None
        types = [_type_proto(im, name).SerializeToString() for name in node.input]
        try:
            raw = schema.get_context_dependent_function_with_opset_version(v, node.SerializeToString(), types)
        except Exception:  # noqa: BLE001  (onnx refuses contexts it cannot build a body for)
            return None
    else:
        return None
    if not raw:
        return None
    fn = onnx.FunctionProto()
    fn.ParseFromString(raw)
    return fn if fn.node else None


def _since(op_type: str, opset: int) -> int:
    import onnx

    try:
        return onnx.defs.get_schema(op_type, opset, "").since_version
    except onnx.defs.SchemaError:
        return -1


def _type_proto(im: Importer, name: str) -> Any:
    from onnx import TypeProto, helper

    if not name:
        return TypeProto()
    value = im.values.get(name)
    if isinstance(value, Known):
        return helper.make_tensor_type_proto(dtypes.onnx_element_type(dtypes.int64), [] if value.scalar else [len(value.values)])
    if isinstance(value, Tensor):
        shape = [d if isinstance(d, int) else None for d in value.shape]
        return helper.make_tensor_type_proto(dtypes.onnx_element_type(value.dtype), shape)
    return TypeProto()


@function_expander
def expand(im: Importer, node: Any, opset: int) -> bool:
    """Import node from its function body; False when its schema defines none."""
    fn = function_body(im, node, opset)
    if fn is None:
        return False
    import onnx

    schema = onnx.defs.get_schema(node.op_type, opset, "")
    unknown = sorted({a.name for a in node.attribute} - set(schema.attributes))
    if unknown:  # the body would ignore it
        raise UnsupportedError(f"ONNX op {node.op_type} (node {node.name!r}, opset {opset}): attribute {unknown[0]} is "
                               f"not an attribute of {node.op_type}-{schema.since_version}")  # fmt: skip
    attrs = {name: a.default_value for name, a in schema.attributes.items() if a.default_value.name}
    attrs.update({a.name: a for a in node.attribute})
    body_opset = next((o.version for o in fn.opset_import if o.domain in ("", "ai.onnx")), opset)
    actual = [im.values[name] if name else None for name in node.input]
    # The body runs in its own scope: formal names bound to the node's values, internal names local.
    outer = im.values
    im.values = outer.new_child()
    try:
        for i, formal in enumerate(fn.input):
            im.values[formal] = actual[i] if i < len(actual) else None
        for body_node in fn.node:
            if body_node.domain not in ("", "ai.onnx"):
                raise UnsupportedError(f"the function body of {node.op_type} uses {body_node.domain}::{body_node.op_type}")
            inner = onnx.NodeProto()
            inner.CopyFrom(body_node)
            _bind_attribute_refs(inner, attrs)
            inner.name = f"{node.name or node.op_type}/{body_node.name or body_node.op_type}"
            im.import_node(inner, body_opset)
        results = []
        for i, formal in enumerate(fn.output):
            wanted = i < len(node.output) and node.output[i]
            if wanted and formal not in im.values.maps[0]:
                raise UnsupportedError(f"the function body of {node.op_type} does not define output {formal}")
            results.append(im.values[formal] if wanted else None)
    finally:
        im.values = outer
    im.bind_outputs(node.output, results)
    return True


def _bind_attribute_refs(node: Any, attrs: dict[str, Any]) -> None:
    """Replace attribute references (`@alpha`) in node and its subgraphs by the caller's values;
    a reference to an attribute the caller left out (and has no default) is dropped."""
    import onnx

    kept = []
    for a in node.attribute:
        if a.ref_attr_name:
            src = attrs.get(a.ref_attr_name)
            if src is None:
                continue
            b = onnx.AttributeProto()
            b.CopyFrom(src)
            b.name = a.name
            kept.append(b)
            continue
        for g in [a.g, *a.graphs] if a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) else []:
            for sub in g.node:
                _bind_attribute_refs(sub, attrs)
        kept.append(a)
    del node.attribute[:]
    node.attribute.extend(kept)
