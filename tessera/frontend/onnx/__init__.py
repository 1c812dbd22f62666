"""The ONNX front end.

    graph = tessera.onnx.load("model.onnx")               # a FlowGraph (ONNX opsets 7 to the newest)
    model = tessera.onnx.compile("model.onnx", "cpu")     # compiled; specialises on shape-like inputs
    outputs = model(x, axes=np.array([1]))

`load` imports an ONNX model as a FlowGraph (importer.py; the rules per op family in
rules_math.py, rules_linalg.py, rules_nn.py, rules_resize.py, rules_shape.py,
rules_control.py and rules_misc.py; ops defined by an ONNX function imported from it, functions.py).
`compile` wraps load + compile_graph and handles inputs whose values the graph needs at
import time (specialize.py).
"""

# Importing the rule modules registers their rules (functions: ops from their function bodies).
from tessera.frontend.onnx import (  # noqa: F401
    functions,
    rules_control,
    rules_linalg,
    rules_math,
    rules_misc,
    rules_nn,
    rules_resize,
    rules_rnn,
    rules_sample,
    rules_shape,
)
from tessera.frontend.onnx.importer import (
    ONNX_DTYPES,
    RULES,
    Importer,
    Known,
    ShapeInputError,
    load,
    rule,
)
from tessera.frontend.onnx.specialize import OnnxModel, compile  # noqa: A004

__all__ = ["ONNX_DTYPES", "RULES", "Importer", "Known", "OnnxModel", "ShapeInputError", "compile", "load", "rule"]
