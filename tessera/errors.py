"""Errors raised by tessera.  A leaf module: every layer may import it."""

from __future__ import annotations


class TesseraError(Exception):
    """Base class of tessera's errors."""


class KernelSyntaxError(TesseraError):
    """A kernel uses an unsupported construct or is ill-typed; points at the source line."""

    def __init__(self, message: str, kernel: str = "?", filename: str = "<unknown>", line: int = 0,
                 col: int = 0, source_line: str = ""):  # fmt: skip
        self.message, self.kernel, self.filename, self.line, self.col = message, kernel, filename, line, col
        text = f"in kernel '{kernel}' at {filename}:{line}: {message}"
        if source_line:
            text += f"\n    {source_line.rstrip()}\n    {' ' * col}^"
        super().__init__(text)


class CompilationError(TesseraError):
    """gcc or nvcc rejected generated code; carries the compiler log and the source path."""

    def __init__(self, compiler: str, command: list[str], log: str, source_path: str,
                 problem: str = "failed to compile generated code"):  # fmt: skip
        self.compiler, self.command, self.log, self.source_path = compiler, command, log, source_path
        super().__init__(
            f"{compiler} {problem}.\n"
            f"  generated source: {source_path}\n  command: {' '.join(command)}\n"
            f"--- compiler log ---\n{log.strip()}\n--- end of log ---"
        )


class BrokenCompilerError(CompilationError):
    """The compiler could not be run, or exited successfully without writing its output: a
    problem with the compiler (e.g. $TESSERA_CC naming something that is not gcc), not with
    the generated code, so retrying with other code cannot help."""


class CompilerNotFoundError(TesseraError):
    """gcc or nvcc is not installed or not on PATH."""


class FileFormatError(TesseraError):
    """A model or compiled-graph file is unreadable, malformed or fails verification."""


class TuningError(TesseraError):
    """Every candidate of a tuning run failed to build, faulted or computed a wrong result."""


class UnsupportedError(TesseraError):
    """A feature that tessera (or this backend) does not support yet."""


class DataTypeError(UnsupportedError, TypeError):
    """A data type with no counterpart where one is needed (numpy has no int4, ONNX no e4m3):
    an UnsupportedError, and a TypeError as numpy and torch raise for a dtype they lack."""


class ArgumentError(TesseraError, TypeError):
    """A kernel was called with arguments of the wrong dtype, shape, device or layout."""


class ShapeError(TesseraError, ValueError):
    """Shapes, sizes or attributes that do not fit together (graph shape inference, run-time
    shapes that break the graph's assumptions, a symbolic size no input binds)."""


class DeviceError(TesseraError):
    """No usable CUDA driver or GPU, or a CUDA call failed."""


class DivisionByZeroError(TesseraError, ZeroDivisionError, RuntimeError):
    """A CPU kernel divided an integer by zero (`//` or `%`).

    A ZeroDivisionError like Python's, and a RuntimeError like torch's on the CPU.  The
    kernel ran to the end with 0 for each such quotient; its outputs are not meaningful."""


class IndexOutOfRangeError(ArgumentError, IndexError):
    """A CPU kernel met a gather index outside [-n, n) (take, gather_elements, gather_nd).

    An IndexError like numpy's and torch's.  The kernel ran to the end with such indices
    clamped; its outputs are not meaningful."""


class NegativePowerError(ArgumentError, ValueError):
    """A CPU kernel raised an integer to a negative integer power (numpy and ONNX's reference
    refuse it: the result is not an integer).  The kernel ran to the end; its outputs are not
    meaningful.  CUDA kernels give 1/a**-b truncated toward zero (1, -1 or 0), as torch does."""


# The status word every CPU kernel reports through its last parameter (backend.codegen_c).
STATUS_DIVISION_BY_ZERO = 1
STATUS_INDEX_OUT_OF_RANGE = 2
STATUS_NEGATIVE_POWER = 3


def raise_for_status(status: int, kernel: str) -> None:
    """Raise the error a CPU kernel's nonzero status word stands for."""
    if status == STATUS_DIVISION_BY_ZERO:
        raise DivisionByZeroError(f"{kernel}: integer division or modulo by zero (on the CPU this raises, as in "
                                  "torch; on CUDA the quotient is 0)")  # fmt: skip
    if status == STATUS_INDEX_OUT_OF_RANGE:
        raise IndexOutOfRangeError(f"{kernel}: an index is out of range for the axis it indexes (on the CPU this "
                                   "raises, as in numpy and torch; CUDA kernels clamp it)")  # fmt: skip
    if status == STATUS_NEGATIVE_POWER:
        raise NegativePowerError(f"{kernel}: an integer raised to a negative integer power (not an integer; numpy "
                                 "and ONNX refuse it on the CPU; cast the base to a float type for such powers)")
    if status:
        raise TesseraError(f"{kernel}: reported an unknown status {status}")


class RequestError(TesseraError, ValueError):
    """A generation request tessera.llm cannot serve as asked: a prompt past the context length,
    a sampling parameter out of range, an unknown model.  The server answers it with HTTP 400."""
