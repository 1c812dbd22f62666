"""Keep transformers' mixture-of-experts blocks whole: each becomes the custom op `tessera::fused_moe`.

transformers' MoE blocks dispatch tokens to experts with data-dependent code: the `grouped_mm`
experts sort the choices, count them with `histc` and call `transformers::grouped_mm_fallback`
(which tessera cannot lower, so they run in torch), and the eager experts loop over the experts
hit (a graph break per block).  Before AOTAutograd runs, `keep_moe_whole` finds each block in
dynamo's graph by structure -- the nodes dynamo recorded inside one module (`nn_module_stack`)
that owns an experts child with fused 3-D weights `gate_up_proj` [E, 2I, H] and `down_proj`
[E, H, I], a router child with an [E, H] weight feeding one `topk`, optionally a shared SiLU MLP
(`gate_proj`, `up_proj`, `down_proj`) and a [1, H] sigmoid gate -- and replaces the block's
nodes with one `tessera::fused_moe` call, which tracing keeps as one node and `aten_nn` lowers
to the fused_moe graph operator (tessera.templates.moe).  This covers Mixtral, Qwen2-MoE,
Qwen3-MoE and the models that copy their blocks, whatever experts implementation the config
picks, and DeepSeek-V3's (a sigmoid router with a choice-bias buffer and group-limited top-k,
three `topk`s, and an ungated shared MLP).  A block that does anything else (another router,
a jitter, another activation, router logits the model returns) is left as it was, the reason logged.
"""

from __future__ import annotations

import logging
import math
import operator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

log = logging.getLogger("tessera")


@torch.library.custom_op("tessera::fused_moe", mutates_args=())
def fused_moe(x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
              shared_gate_proj: torch.Tensor | None, shared_up_proj: torch.Tensor | None,
              shared_down_proj: torch.Tensor | None, shared_gate: torch.Tensor | None, choice_bias: torch.Tensor | None,
              top_k: int, scoring: str, normalize: bool, scale: float, groups: int, topk_group: int) -> torch.Tensor:  # fmt: skip
    """A mixture-of-experts block on x [..., H] (tessera.graph.opdefs.moe gives the semantics;
    the shared expert's gate and up weights arrive separately here).  Routing in float32, as
    transformers' routers do; this body is what runs where tessera does not (the GPU)."""
    rows = x.reshape(-1, x.shape[-1])
    logits = F.linear(rows.float(), router.float())
    scores = logits.softmax(-1) if scoring == "softmax" else logits.sigmoid()
    choice = scores + choice_bias.float() if choice_bias is not None else scores
    if groups > 1:
        per = choice.view(len(choice), groups, -1)
        keep = per.topk(2, dim=-1).values.sum(-1).topk(topk_group, dim=-1).indices
        mask = torch.zeros_like(per[..., 0], dtype=torch.bool).scatter_(1, keep, True)
        choice = per.masked_fill(~mask[..., None], float("-inf")).view_as(choice)
    experts = torch.topk(choice, top_k, dim=-1).indices
    weights = scores.gather(1, experts)
    if normalize:
        weights = weights / weights.sum(-1, keepdim=True)
    weights = (weights * scale).to(x.dtype)
    out = torch.zeros_like(rows)
    for e in experts.unique().tolist():
        token, choice = torch.where(experts == e)
        gate, up = F.linear(rows[token], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[e]) * weights[token, choice, None]
        out.index_add_(0, token, y)
    if shared_down_proj is not None:
        h = F.silu(F.linear(rows, shared_gate_proj)) * F.linear(rows, shared_up_proj)
        y = F.linear(h, shared_down_proj)
        out = out + (torch.sigmoid(F.linear(rows, shared_gate)) * y if shared_gate is not None else y)
    return out.reshape(x.shape)


@fused_moe.register_fake
def _(x, router, gate_up, down, shared_gate_proj, shared_up_proj, shared_down_proj, shared_gate, choice_bias, top_k,
      scoring, normalize, scale, groups, topk_group):  # fmt: skip
    return torch.empty_like(x)


_SOFTMAX = {F.softmax, torch.softmax, torch.Tensor.softmax, "softmax"}
_SIGMOID = {torch.sigmoid, F.sigmoid, torch.Tensor.sigmoid, "sigmoid"}
_TOPK = {torch.topk, torch.Tensor.topk, "topk"}
_SILU = {F.silu, "silu"}
# What a router may do besides its linear, scoring, top-k and normalisation: views and casts.
_ROUTER_PLUMBING = {F.linear, operator.getitem, "float", "to", "reshape", "view", "type", "contiguous"}
_NORMALIZE = {operator.truediv, operator.itruediv, torch.div, "div", "div_", "sum", torch.sum}
_DIVIDE = _NORMALIZE - {"sum", torch.sum}
# ... and a group-limited router (DeepSeek-V3's): a choice bias, the groups' mask, a gather, a scale.
_GROUPED = {operator.add, operator.iadd, "add", operator.mul, operator.imul, "mul", "unsqueeze", "expand",
            torch.zeros_like, "scatter_", "scatter", operator.invert, "bool", "masked_fill", "gather"}  # fmt: skip


def _path(node: torch.fx.Node) -> str | None:
    """The innermost module the node was traced in ("L['self'].model.layers.0.mlp")."""
    stack = node.meta.get("nn_module_stack")
    return list(stack.values())[-1][0] if stack else None


def _inside(node: torch.fx.Node, path: str) -> bool:
    if "." not in path:  # the block is what was compiled: its own nodes have no module stack
        return node.op != "output"
    stack = node.meta.get("nn_module_stack") or {}
    return any(p == path or p.startswith(path + ".") for p, _ in stack.values())


def _target(node: torch.fx.Node):
    return node.target if node.op in ("call_function", "call_method") else None


def _param(node: torch.fx.Node, attr: str) -> bool:
    return node.op == "placeholder" and node.name.rstrip("_").endswith("_parameters_" + attr)


def _shape(node: torch.fx.Node) -> tuple | None:
    value = node.meta.get("example_value")
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


@dataclass
class _Block:
    """One MoE block found in the graph: its nodes and what the fused op needs."""

    path: str
    nodes: list[torch.fx.Node] = field(default_factory=list)
    weights: dict[str, torch.fx.Node] = field(default_factory=dict)
    top_k: int = 0
    scoring: str = "softmax"
    normalize: bool = False
    scale: float = 1.0
    groups: int = 1
    topk_group: int = 1


def _k(topk: torch.fx.Node) -> object:
    return topk.args[1] if len(topk.args) > 1 else topk.kwargs.get("k")


def _router(block: _Block, topks: list[torch.fx.Node], inputs: list[torch.fx.Node]) -> str | None:
    """Read the router's semantics from its nodes; None, or why the block is left alone.  One
    top-k: Mixtral's and Qwen's routers; three (within groups, of groups, of experts): DeepSeek-V3's."""
    topk = topks[-1]
    rpath = _path(topk)
    router_nodes = [n for n in block.nodes if n.op != "placeholder" and _path(n) == rpath]
    state = [n for n in inputs if n.op == "placeholder" and _path(n) == rpath]
    weight = [n for n in state if _param(n, "weight") and len(_shape(n) or ()) == 2]
    if len(weight) != 1:
        return "its router has no [E, H] weight"
    experts = _shape(weight[0])[0]
    bias = [n for n in state if n is not weight[0] and _shape(n) == (experts,)]
    if len(state) != 1 + len(bias) or len(bias) > 1 or len(bias) > len(topks) - 1:
        return "its router has state other than its weight (and a grouped router's choice bias)"
    block.weights["router"] = weight[0]
    if bias:
        block.weights["choice_bias"] = bias[0]
    seen = {_target(n) for n in router_nodes}
    scoring = [s for s, ops in (("softmax", _SOFTMAX), ("sigmoid", _SIGMOID)) if seen & ops]
    allowed = _SOFTMAX | _SIGMOID | _TOPK | _ROUTER_PLUMBING | _NORMALIZE | (_GROUPED if len(topks) == 3 else set())
    if len(scoring) != 1 or seen - allowed or len(topks) not in (1, 3):
        return f"its router computes {sorted(map(str, seen - allowed or seen))}, not softmax or sigmoid top-k"
    k = _k(topk)
    dim = topk.args[2] if len(topk.args) > 2 else topk.kwargs.get("dim", -1)
    largest = topk.args[3] if len(topk.args) > 3 else topk.kwargs.get("largest", True)
    if not isinstance(k, int) or dim not in (-1, 1) or largest is not True:
        return "its router's top-k is not k largest over the experts"
    block.top_k, block.scoring = k, scoring[0]
    if len(topks) == 3:  # top-2 within groups of a [T, G, E / G] view, then the best groups
        view = topks[0].args[0]
        sizes = view.args[1:] if isinstance(view, torch.fx.Node) and _target(view) in ("view", "reshape") else ()
        if len(sizes) != 3 or not all(isinstance(d, int) for d in sizes[1:]) or _k(topks[0]) != 2 \
                or sizes[1] * sizes[2] != experts or not isinstance(_k(topks[1]), int):  # fmt: skip
            return "its router's groups are not a top-2 sum over equal groups of experts"
        block.groups, block.topk_group = sizes[1], _k(topks[1])
        constants = [a for n in router_nodes if _target(n) in (operator.mul, operator.imul, "mul")
                     for a in n.args if isinstance(a, (int, float))]  # fmt: skip
        block.scale = float(math.prod(constants))
        block.normalize = bool(seen & _DIVIDE)
    else:
        block.normalize = bool(seen & {"sum", torch.sum}) and bool(seen & _DIVIDE)
    return None


def _find(gm: torch.fx.GraphModule, experts_path: str) -> _Block | str:
    """The block owning the experts module at `experts_path`, or why it cannot be replaced."""
    path = experts_path.rsplit(".", 1)[0]
    block = _Block(path, [n for n in gm.graph.nodes if n.op != "placeholder" and _inside(n, path)])
    inside = set(block.nodes)
    inputs = list(dict.fromkeys(a for n in block.nodes for a in n.all_input_nodes if a not in inside))
    params = [n for n in inputs if n.op == "placeholder" and ("_parameters_" in n.name or "_buffers_" in n.name)
              and _inside(n, path)]  # fmt: skip
    tensors = [n for n in inputs if n not in params and isinstance(n.meta.get("example_value"), torch.Tensor)]
    # (sizes the block read, dynamo may reuse after it: those nodes stay, the tensors must not)
    outputs = [n for n in block.nodes if any(u not in inside for u in n.users) and _shape(n) is not None]
    if len(tensors) != 1 or len(outputs) != 1 or _shape(outputs[0]) != _shape(tensors[0]):
        return "its nodes do not take one hidden state and give one of the same shape"
    block.weights["x"], block.weights["out"] = tensors[0], outputs[0]
    for name in ("gate_up_proj", "down_proj"):
        found = [n for n in params if _param(n, name) and _path(n) == experts_path]
        if len(found) != 1:
            return f"its experts have no {name}"
        block.weights[name] = found[0]
    topks = [n for n in block.nodes if _target(n) in _TOPK]
    if not topks:
        return "it has no top-k choice"
    why = _router(block, topks, inputs)
    if why:
        return why
    rest = [n for n in params if n not in block.weights.values()]
    shared = {k: [n for n in rest if _param(n, "weight") and _path(n).endswith("." + k)]
              for k in ("gate_proj", "up_proj", "down_proj")}  # fmt: skip
    if any(shared.values()):
        if any(len(v) != 1 for v in shared.values()):
            return "its shared expert is not one gate/up/down MLP"
        block.weights.update({"shared_" + k: v[0] for k, v in shared.items()})
    gate = [n for n in rest if n not in block.weights.values()]
    if gate:
        if len(gate) != 1 or not _param(gate[0], "weight") or _shape(gate[0]) != (1, _shape(tensors[0])[-1]) \
                or not any(_target(n) in _SIGMOID and _path(n) != _path(topks[0]) for n in block.nodes):  # fmt: skip
            return "it has weights other than a router, experts, a shared expert and its sigmoid gate"
        block.weights["shared_gate"] = gate[0]
    hidden, experts = _shape(tensors[0])[-1], _shape(block.weights["router"])[0]
    inter = (_shape(block.weights["down_proj"]) or (0, 0, 0))[-1]
    if _shape(block.weights["router"]) != (experts, hidden) or _shape(block.weights["down_proj"]) != (
        experts, hidden, inter) or _shape(block.weights["gate_up_proj"]) != (experts, 2 * inter, hidden):  # fmt: skip
        return "its weights are not router [E, H], gate_up_proj [E, 2I, H] and down_proj [E, H, I] (transposed?)"
    if not any(_target(n) in ("chunk", torch.chunk) and _inside(n, experts_path) for n in block.nodes):
        return "its experts do not split gate_up_proj's output into gate and up halves (interleaved?)"
    mlps = [experts_path]
    if any(shared.values()):
        mlps.append(_path(block.weights["shared_gate_proj"]).rsplit(".", 1)[0])
    if not all(any(_target(n) in _SILU and _inside(n, mlp) for n in block.nodes) for mlp in mlps):
        return "its experts' activation is not SiLU"
    return block


def keep_moe_whole(gm: torch.fx.GraphModule) -> int:
    """Replace each recognised MoE block of dynamo's graph by `tessera::fused_moe`; the number replaced."""
    experts = dict.fromkeys(_path(n) for n in gm.graph.nodes if _param(n, "gate_up_proj") and len(_shape(n) or ()) == 3)
    count = 0
    for experts_path in experts:
        block = _find(gm, experts_path)
        if isinstance(block, str):
            log.info("tessera: the MoE block %s stays as traced: %s", experts_path.rsplit(".", 1)[0], block)
            continue
        w, out = block.weights, block.weights["out"]
        with gm.graph.inserting_after(out):
            new = gm.graph.call_function(torch.ops.tessera.fused_moe.default,
                                         (w["x"], w["router"], w["gate_up_proj"], w["down_proj"],
                                          w.get("shared_gate_proj"), w.get("shared_up_proj"), w.get("shared_down_proj"),
                                          w.get("shared_gate"), w.get("choice_bias"), block.top_k, block.scoring,
                                          block.normalize, block.scale, block.groups, block.topk_group))  # fmt: skip
        new.meta = dict(out.meta)
        out.replace_all_uses_with(new)
        for node in reversed(block.nodes):
            if not node.users:  # (a size read after the block keeps the nodes it needs)
                gm.graph.erase_node(node)
        count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count
