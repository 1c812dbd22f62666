"""tessera.ops: tensor operators as compute definitions, and the auto-scheduler that builds them.

Build a computation from placeholders and ops, then compile it::

    import numpy as np
    from tessera import ops
    from tessera.ir import Var, dtypes

    n = Var("n", dtypes.int32)                      # a dynamic batch size
    x = ops.placeholder((n, 768), "float32", "x")
    w = ops.placeholder((768,), "float32", "w")
    y = ops.gelu(ops.layer_norm(x, w))              # compute nodes, nothing runs yet
    f = ops.build([y], [x, w], target="cpu")        # fused kernels, compiled once
    out = f(np.random.rand(4, 768).astype(np.float32), np.ones(768, np.float32))

Injective ops (elementwise, broadcast, reshape, transpose, slice, concat, pad, gathers) are
inlined into their consumers; reductions fuse with their injective prologue and epilogue.
"""

from tessera.ir.compute import (
    Compute,
    Placeholder,
    Program,
    ReduceCompute,
    TensorElement,
    TensorNode,
    compute,
    placeholder,
    reduce,
)
from tessera.ops.compiled import CompiledOp, Generated, build, build_many, generate
from tessera.ops.creation import arange, causal_mask, full, tril, triu
from tessera.ops.elementwise import (
    abs,
    add,
    bitcast,
    bitwise_and,
    bitwise_or,
    cast,
    ceil,
    clamp,
    cos,
    div,
    elementwise,
    elu,
    eq,
    erf,
    exp,
    exp2,
    expm1,
    floor,
    floor_divide,
    ge,
    gelu,
    gt,
    hardsigmoid,
    hardswish,
    isnan,
    le,
    leaky_relu,
    log,
    log1p,
    log2,
    logical_and,
    logical_not,
    logical_or,
    logical_xor,
    lt,
    maximum,
    minimum,
    mish,
    mul,
    ne,
    neg,
    pow,
    reciprocal,
    relu,
    remainder,
    round,
    rsqrt,
    sigmoid,
    sign,
    silu,
    sin,
    softplus,
    sqrt,
    square,
    sub,
    tan,
    tanh,
    trunc,
    where,
)
from tessera.ops.linalg import bmm, linear, matmul
from tessera.ops.nn import (
    adaptive_avg_pool2d,
    apply_rotary,
    attention,
    avg_pool2d,
    conv2d,
    max_pool2d,
    rotate_half,
)
from tessera.ops.norm import batch_norm, layer_norm, rms_norm
from tessera.ops.programs import det, index_copy, scatter_elements, scatter_nd, topk
from tessera.ops.reductions import (
    argmax,
    argmin,
    cumsum,
    log_softmax,
    logsumexp,
    max,
    mean,
    min,
    prod,
    reduce_axes,
    softmax,
    std,
    sum,
    var,
)
from tessera.ops.transform import (
    broadcast_to,
    chunk,
    concat,
    embedding,
    expand,
    flatten,
    flip,
    gather,
    index_select,
    narrow,
    pad,
    permute,
    reshape,
    slice,
    split,
    squeeze,
    take,
    tile,
    transpose,
    unsqueeze,
)

__all__ = [
    "Compute", "Placeholder", "Program", "ReduceCompute", "TensorElement", "TensorNode", "compute", "placeholder", "reduce",
    "CompiledOp", "Generated", "build", "build_many", "generate",
    "abs", "add", "bitcast", "bitwise_and", "bitwise_or", "cast", "ceil", "clamp", "cos", "div", "elementwise", "elu", "eq",
    "erf", "exp", "exp2", "expm1", "floor", "floor_divide", "ge", "gelu", "gt", "hardsigmoid", "hardswish", "isnan",
    "le", "leaky_relu", "log", "log1p", "log2", "logical_and", "logical_not", "logical_or", "logical_xor", "lt",
    "maximum", "minimum", "mish", "mul", "ne", "neg", "pow", "reciprocal", "relu", "remainder", "round", "rsqrt",
    "sigmoid", "sign", "silu", "sin", "softplus", "sqrt", "square", "sub", "tan", "tanh", "trunc", "where",
    "arange", "causal_mask", "full", "tril", "triu",
    "bmm", "linear", "matmul",
    "adaptive_avg_pool2d", "apply_rotary", "attention", "avg_pool2d", "conv2d", "max_pool2d", "rotate_half",
    "batch_norm", "layer_norm", "rms_norm",
    "det", "index_copy", "scatter_elements", "scatter_nd", "topk",
    "argmax", "argmin", "cumsum", "log_softmax", "logsumexp", "max", "mean", "min", "prod", "reduce_axes",
    "softmax", "std", "sum", "var",
    "broadcast_to", "chunk", "concat", "embedding", "expand", "flatten", "flip", "gather", "index_select", "narrow", "pad",
    "permute", "reshape", "slice", "split", "squeeze", "take", "tile", "transpose", "unsqueeze",
]  # fmt: skip
