"""The Python kernel front end: builtins usable in kernels and the AST parser."""

from tessera.lang.parser import parse_kernel

__all__ = ["parse_kernel"]
