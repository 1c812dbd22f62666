"""Anchor operators on the GPU: which graph operators run on kernel templates
(tessera.ops.anchors: the tuned GEMM, convolution as im2col + GEMM, attention as two GEMMs
around a row softmax, layer norm / RMS norm / softmax on the tuned row kernels) and how a
group's elementwise tail becomes the template's epilogue (post-scheduling fusion)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tessera import ops
from tessera.backend.isa import vector_lanes
from tessera.errors import UnsupportedError
from tessera.graph.compiler.partition import Group
from tessera.graph.lowering import lower_operator
from tessera.graph.operator import Operator
from tessera.graph.tensor import Tensor
from tessera.ir import dtypes
from tessera.kernels.lowbit_decode_config import group_ok
from tessera.ops import anchors
from tessera.ops.anchors import Epilogue, cpu_conv, cpu_gemm
from tessera.ops.anchors.attention import flash_unsupported, plan_attention
from tessera.ops.anchors.conv import _pads, _pair
from tessera.ops.anchors.cpu_pool import plan_cpu_max_pool2d
from tessera.ops.anchors.row import prepare_row
from tessera.quant.anchor import prepare_lowbit_linear
from tessera.quant.anchor_cpu import cpu_kernels_take, plan_lowbit_linear_cpu

ANCHOR_KINDS = ("matmul", "linear", "conv2d", "scaled_dot_product_attention", "lowbit_linear")
ROW_KINDS = {"layer_norm": 3, "rms_norm": 2, "softmax": 1}  # kind -> inputs the row kernel takes
_TEMPLATE_DTYPES = (dtypes.float16, dtypes.bfloat16)
_ROW_DTYPES = (dtypes.float16, dtypes.bfloat16, dtypes.float32)


def is_row_anchor(op: Operator) -> bool:
    """Layer norm (weight and bias), RMS norm (weight) over the last axis, softmax over the last
    axis, in float16/bfloat16/float32, with parameters of x's dtype: the tuned row kernels."""
    if op.kind not in ROW_KINDS or len(op.inputs) != ROW_KINDS[op.kind]:
        return False
    x = op.inputs[0]
    if x.dtype not in _ROW_DTYPES or any(t.dtype != x.dtype for t in op.inputs) or x.ndim < 1:
        return False
    if op.kind == "softmax":
        return op.attrs.get("axis") in (-1, x.ndim - 1)
    return op.attrs.get("num_axes", 1) == 1


def is_anchor(op: Operator, target: str = "cuda") -> bool:
    """Whether a kernel template runs op: on the GPU fp16/bf16 GEMMs, group-1 convolutions and
    attention, and float16 lowbit_linear; on the CPU float32 linear, matmul and group-1 conv2d
    (the x86 micro-kernel), attention, max_pool2d (a row kernel) and float32 lowbit_linear."""
    if target == "cpu":
        return _is_cpu_anchor(op)
    if is_row_anchor(op):
        return True
    if op.kind not in ANCHOR_KINDS or op.outputs[0].dtype not in _TEMPLATE_DTYPES:
        return False
    if op.kind == "lowbit_linear":  # float16 x [..., K] with constant low-bit weights, K and group the kernel takes

        k, gs = op.attrs["k"], op.attrs["group_size"]
        return _is_lowbit_anchor(op, dtypes.float16) and k % 8 == 0 and (gs >= k or group_ok(gs))
    if op.kind == "scaled_dot_product_attention":  # the template: [B, H, S, D] q, k, v, optional mask
        qkv, mask = op.inputs[:3], op.inputs[3:]  # infer checked that the mask broadcasts to [B, H, Sq, Sk]
        mask_dtypes = (dtypes.boolean, dtypes.float16, dtypes.bfloat16, dtypes.float32, dtypes.float64)
        return (len(op.inputs) in (3, 4) and all(t.ndim == 4 and t.dtype == op.outputs[0].dtype for t in qkv)
                and all(1 <= t.ndim <= 4 and t.dtype in mask_dtypes for t in mask))  # fmt: skip
    if any(t.dtype != op.outputs[0].dtype for t in op.inputs):
        return False
    if op.kind == "conv2d":
        return op.attrs.get("groups", 1) == 1
    return op.inputs[0].ndim >= 2 and op.inputs[1].ndim >= 2 if op.kind == "matmul" else True


def _is_cpu_anchor(op: Operator) -> bool:
    if _is_cpu_pool(op):
        return True
    if op.kind not in ANCHOR_KINDS or vector_lanes() == 1:
        return False
    if op.kind == "lowbit_linear":  # the row-layout kernels (tessera.kernels.lowbit_cpu), built per M like the GPU's

        return _is_lowbit_anchor(op, dtypes.float32) and cpu_kernels_take(op.attrs["group_size"], op.attrs["k"])
    if op.kind == "scaled_dot_product_attention":
        qkv, mask = op.inputs[:3], op.inputs[3:]
        static = all(isinstance(d, int) for t in op.inputs for d in t.shape)
        return (static and op.outputs[0].dtype == dtypes.float32 and len(op.inputs) in (3, 4)
                and all(t.ndim == 4 and t.dtype == dtypes.float32 for t in qkv)
                and all(1 <= t.ndim <= 4 and t.dtype in (dtypes.boolean, dtypes.float32) for t in mask))  # fmt: skip
    if any(t.dtype != dtypes.float32 for t in (*op.inputs, *op.outputs)):
        return False
    # A template is specialised to its shapes; symbolic sizes stay on the generic kernels, which
    # serve every size from one build (a CPU GEMM per batch size would cost a gcc run each).
    if not all(isinstance(d, int) for t in (*op.inputs, *op.outputs) for d in t.shape):
        return False
    if op.kind == "conv2d":  # the x86 implicit GEMM reads NCHW
        return op.attrs.get("groups", 1) == 1 and op.inputs[0].ndim == 4 and op.attrs.get("layout", "NCHW") == "NCHW"
    return True


def _is_lowbit_anchor(op: Operator, dtype: dtypes.DataType) -> bool:
    """lowbit_linear of an x [..., K] of `dtype` (the target's kernel's; its rows are one [M, K]
    matrix) and constant low-bit weights."""
    x = op.inputs[0]
    return x.ndim >= 1 and x.dtype == dtype and all(t.is_constant for t in op.inputs[1:])


def _is_cpu_pool(op: Operator) -> bool:
    """max_pool2d over a static float32 NCHW tensor (the lowering has checked the padding): the row kernel."""
    if op.kind != "max_pool2d" or len(op.inputs) != 1 or vector_lanes() == 1 or op.attrs.get("layout", "NCHW") != "NCHW":
        return False
    x = op.inputs[0]
    return (x.ndim == 4 and x.dtype == dtypes.float32 and op.outputs[0].dtype == dtypes.float32
            and all(isinstance(d, int) for t in (x, *op.outputs) for d in t.shape))  # fmt: skip


def attention_views(op: Operator, consumers: Mapping[Tensor, list[Operator]], outputs: set[Tensor],
                    target: str = "cuda") -> tuple[list[Operator], list[Operator]]:  # fmt: skip
    """The head views the GPU attention anchor reads and writes in place (partition's `views`):
    the `split_heads` producing q, k, v (batch 1, static shapes, columns and row width on
    16-byte boundaries; q only without grouped heads: the flash kernel's strided TMA maps)
    and the `merge_heads` after it (its store writes [B, Sq, H * D]), each read by the
    attention alone; only where the fused flash kernel runs (it alone takes them)."""
    if target != "cuda" or op.kind != "scaled_dot_product_attention":
        return [], []

    if not all(isinstance(d, int) for t in op.inputs for d in t.shape):
        return [], []
    q, k, v = op.inputs[:3]
    if flash_unsupported(q.shape, k.shape, v.shape, op.inputs[3].shape if len(op.inputs) == 4 else None) is not None:
        return [], []
    before = []
    for i, t in enumerate((q, k, v)):
        view = t.producer
        if (view is None or view.kind != "split_heads" or consumers.get(t) != [op] or t in outputs
                or op.inputs.count(t) != 1 or q.shape[0] != 1 or (i == 0 and q.shape[1] != k.shape[1])):  # fmt: skip
            continue
        width = view.inputs[0].shape[2]
        if isinstance(width, int) and width % 8 == 0 and view.attrs["offset"] % 8 == 0:
            before.append(view)
    users = consumers.get(op.outputs[0], [])
    after = users if len(users) == 1 and users[0].kind == "merge_heads" and op.outputs[0] not in outputs else []
    return before, list(after)


def takes_epilogue(op: Operator) -> bool:
    """Whether op's template folds an elementwise tail into its store (the GEMMs do)."""
    return op.kind != "scaled_dot_product_attention"


def _epilogue(group: Group, shapes: Mapping[Tensor, tuple[int, ...]]) -> tuple[Any, list[Tensor]]:
    """The anchor's elementwise tail as an ops.anchors Epilogue, and the tensors it reads."""
    if not group.epilogue:
        return None, []
    acc_t = group.anchor.outputs[0]
    chain_outputs = {op.outputs[0] for op in group.epilogue}
    extra_t = list(dict.fromkeys(t for op in group.epilogue for t in op.inputs if t is not acc_t and t not in chain_outputs))
    out_shape = shapes[group.outputs[0]]
    acc = ops.placeholder(out_shape, acc_t.dtype, "acc")
    extras = [ops.placeholder(shapes[t], t.dtype, f"e{i}") for i, t in enumerate(extra_t)]
    env: dict[Tensor, Any] = {acc_t: acc, **dict(zip(extra_t, extras))}
    for op in group.epilogue:
        env[op.outputs[0]] = lower_operator(op, [env[t] for t in op.inputs], {})[0]
    return Epilogue(acc, env[group.outputs[0]], extras), extra_t


def _conv_geometry(attrs: Mapping[str, Any]) -> dict[str, Any]:
    return {"stride": _pair(attrs["stride"], "stride"), "padding": _pads(attrs["padding"]),
            "dilation": _pair(attrs["dilation"], "dilation")}  # fmt: skip


def _prepare_cpu(op: Operator, in_shapes: list[tuple[int, ...]], epilogue: Any, tune: bool) -> Any:
    """The CPU plan of op: a GEMM with its constant weight packed once (tessera.ops.anchors.cpu_gemm,
    cpu_conv), attention, the max-pool row kernel (cpu_pool), or the low-bit row kernel
    (tessera.quant.anchor, its words re-laid once)."""
    if op.kind == "lowbit_linear":
        return plan_lowbit_linear_cpu(in_shapes[0], op.attrs, op.inputs[1].data, in_shapes[2], in_shapes[3],
                                      epilogue, len(op.inputs)).load()  # fmt: skip

    if op.kind == "max_pool2d":
        a = op.opdef.normalize_attrs(op.attrs)
        pt, pl, _, _ = _pads(a["padding"])
        plan = plan_cpu_max_pool2d(in_shapes[0], _pair(a["kernel"], "kernel"), _pair(a["stride"] or a["kernel"], "stride"),
                                   (pt, pl), ceil_mode=bool(a["ceil_mode"]), epilogue=epilogue)  # fmt: skip
        return plan.load()
    w = op.inputs[1]
    weight = w.data if w.is_constant and w.ndim == (4 if op.kind == "conv2d" else 2) else None
    if op.kind == "linear":
        return cpu_gemm.plan_cpu_linear(in_shapes[0], in_shapes[1], bias=len(op.inputs) == 3, epilogue=epilogue,
                                        weight=weight, tune=tune).load()  # fmt: skip
    if op.kind == "scaled_dot_product_attention":
        if epilogue is not None:
            raise UnsupportedError("the attention template takes no epilogue")
        masked = len(op.inputs) == 4
        return plan_attention(*in_shapes[:3], dtypes.float32, causal=bool(op.attrs.get("causal", False)),
                              scale=op.attrs.get("scale"), mask_shape=in_shapes[3] if masked else None,
                              mask_dtype=op.inputs[3].dtype if masked else None, tune=tune, target="cpu").load()  # fmt: skip
    if op.kind == "matmul":
        return cpu_gemm.plan_cpu_matmul(in_shapes[0], in_shapes[1], epilogue=epilogue, weight=weight, tune=tune).load()
    return cpu_conv.plan_cpu_conv2d(in_shapes[0], in_shapes[1], bias=len(op.inputs) == 3, epilogue=epilogue,
                                    weight=weight, tune=tune, **_conv_geometry(op.attrs)).load()  # fmt: skip


class StepKernel:
    """An anchor kernel called on a step's arrays (group.inputs order): `kernel(operands,
    output, extras)` with the operands and extras picked by position."""

    def __init__(self, kernel: Any, operands: list[int], extras: list[int]):
        self.kernel = kernel
        self.operands, self.extras = operands, extras

    @property
    def temporaries(self) -> list[tuple[tuple[int, ...], Any]]:
        """(shape, dtype) of the buffers the kernel takes per call (AnchorKernel.temporaries):
        the graph compiler places them in its arena for the step's duration."""
        return list(getattr(self.kernel, "temporaries", ()))

    def __call__(self, arrays: Any, outputs: Any, temps: Any = ()) -> None:
        operands, extras = [arrays[i] for i in self.operands], [arrays[i] for i in self.extras]
        if temps:
            self.kernel(operands, outputs[0], extras, temps)
        else:
            self.kernel(operands, outputs[0], extras)

    def sibling(self, *, workspaces: bool = True) -> StepKernel | None:
        """The kernel for another group of the same structure and shapes (loaded kernels shared,
        workspaces its own; see AnchorKernel.sibling), or None when the kernel cannot be shared."""
        make = getattr(self.kernel, "sibling", None)
        return None if make is None else StepKernel(make(workspaces=workspaces), self.operands, self.extras)


def prepare_anchor(group: Group, shapes: Mapping[Tensor, tuple[int, ...]], *, tune: bool = False,
                   target: str = "cuda") -> Any:  # fmt: skip
    """A callable (arrays in group.inputs order, [output]) running the anchor and its epilogue.

    Raises UnsupportedError when no template takes this operator on these shapes."""
    op = group.anchor
    if target == "cuda" and op.kind == "scaled_dot_product_attention":
        return _prepare_attention(group, shapes, tune)
    epilogue, extra_t = _epilogue(group, shapes)
    position = {t: i for i, t in enumerate(group.inputs)}
    operands = [position[t] for t in op.inputs]
    extras = [position[t] for t in extra_t]
    if target == "cpu":
        return StepKernel(_prepare_cpu(op, [shapes[t] for t in op.inputs], epilogue, tune), operands, extras)
    dtype = op.outputs[0].dtype
    in_shapes = [shapes[t] for t in op.inputs]
    if op.kind in ROW_KINDS:
        eps = op.attrs.get("eps", 1e-5)
        kernel = prepare_row(op.kind, in_shapes[0], dtype, eps=float(eps), epilogue=epilogue)
    elif op.kind == "linear":
        kernel = anchors.prepare_linear(in_shapes[0], in_shapes[1], dtype, bias=len(op.inputs) == 3,
                                        epilogue=epilogue, tune=tune)  # fmt: skip
    elif op.kind == "matmul":
        kernel = anchors.prepare_matmul(in_shapes[0], in_shapes[1], dtype, b_layout="kn", epilogue=epilogue, tune=tune)
    elif op.kind == "conv2d":
        a = op.attrs
        kernel = anchors.prepare_conv2d(in_shapes[0], in_shapes[1], dtype, stride=a["stride"],
                                        padding=a["padding"], dilation=a["dilation"],
                                        groups=a.get("groups", 1), bias=len(op.inputs) == 3, epilogue=epilogue, tune=tune,
                                        layout=a.get("layout", "NCHW"))  # fmt: skip
    elif op.kind == "lowbit_linear":
        kernel = prepare_lowbit_linear(in_shapes[0], op.attrs, in_shapes[1][0], in_shapes[2], in_shapes[3], epilogue,
                                       tune=tune, fragment=len(op.inputs) == 5)  # fmt: skip
    else:
        raise UnsupportedError(f"no kernel template for {op.kind}")

    return StepKernel(kernel, operands, extras)


def _prepare_attention(group: Group, shapes: Mapping[Tensor, tuple[int, ...]], tune: bool) -> Any:
    """The GPU attention anchor: q, k, v read through the group's `split_heads` views (from the
    tensor each views), the output written through its `merge_heads` (attention_views)."""
    op = group.anchor
    if any(v.kind != "merge_heads" for v in group.epilogue):
        raise UnsupportedError("the attention template takes no epilogue")
    position = {t: i for i, t in enumerate(group.inputs)}
    viewed = {v.outputs[0]: v for v in group.prologue}
    operands, views, qkv_shapes = [], [], []
    for t in op.inputs[:3]:
        view = viewed.get(t)
        if view is None:
            operands.append(position[t])
            views.append(None)
            qkv_shapes.append(shapes[t])
            continue
        x = view.inputs[0]
        b, s, width = shapes[x]
        operands.append(position[x])
        views.append((int(view.attrs["offset"]), width))
        qkv_shapes.append((b, int(view.attrs["heads"]), s, int(view.attrs["head_dim"])))
    masked = len(op.inputs) == 4
    if masked:
        operands.append(position[op.inputs[3]])
    kernel = anchors.prepare_attention(*qkv_shapes, op.outputs[0].dtype, causal=bool(op.attrs.get("causal", False)),
                                       scale=op.attrs.get("scale"), mask_shape=shapes[op.inputs[3]] if masked else None,
                                       mask_dtype=op.inputs[3].dtype if masked else None, tune=tune, views=views,
                                       heads_last=bool(group.epilogue))  # fmt: skip

    return StepKernel(kernel, operands, [])
