"""The tessera IR: data types, types, expressions, statements, functions and task mappings."""

from tessera.ir import dtypes, printer  # noqa: F401  (printer: registers how nodes print, see tessera.ir.text)
from tessera.ir.dtypes import DataType, dtype
from tessera.ir.expr import Binary, Call, Cast, Const, Expr, HardwareIndex, Load, Select, Unary, Var
from tessera.ir.func import Function, LaunchConfig, Module
from tessera.ir.mapping import TaskMapping, repeat, spatial
from tessera.ir.types import PointerType, TensorType

__all__ = [
    "dtypes", "DataType", "dtype",
    "Binary", "Call", "Cast", "Const", "Expr", "HardwareIndex", "Load", "Select", "Unary", "Var",
    "Function", "LaunchConfig", "Module", "TaskMapping", "repeat", "spatial", "PointerType", "TensorType",
]  # fmt: skip
