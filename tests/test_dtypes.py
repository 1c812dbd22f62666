"""tessera.ir.dtypes, the one home of dtype facts: the numpy, torch and ONNX counterparts of each
DataType (round trips, and agreement with the libraries themselves) and the promotion policies."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tessera.errors import DataTypeError, UnsupportedError
from tessera.ir import dtypes
from tessera.ir.dtypes import (
    ALL_DTYPES,
    NUMPY_DTYPES,
    ONNX_ELEMENT_TYPES,
    TORCH_DTYPES,
    bfloat16,
    boolean,
    e4m3,
    f16,
    f32,
    f64,
    from_numpy_dtype,
    from_torch,
    i8,
    i16,
    i32,
    i64,
    int4,
    numpy_dtype,
    onnx_element_type,
    promote,
    promote_graph,
    promote_torch,
    result_type_torch,
    torch_name,
    u8,
    u16,
    u32,
    u64,
    uint4,
)

bf16 = bfloat16


# ---- numpy ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dt", NUMPY_DTYPES, ids=str)
def test_numpy_round_trip(dt):
    if dt == bf16:
        pytest.importorskip("ml_dtypes")
    nd = numpy_dtype(dt)
    assert nd.itemsize == dt.nbytes
    assert from_numpy_dtype(nd) is dt
    assert from_numpy_dtype(nd.type) is dt  # a scalar type, as np.float32
    assert np.zeros(2, nd).dtype == nd


def test_every_other_dtype_has_no_numpy_counterpart():
    for dt in set(ALL_DTYPES) - set(NUMPY_DTYPES):
        with pytest.raises(DataTypeError, match=f"no numpy dtype holds {dt.name}"):
            numpy_dtype(dt)
    # one error for both ways it was caught: an UnsupportedError and a TypeError
    assert issubclass(DataTypeError, UnsupportedError) and issubclass(DataTypeError, TypeError)


@pytest.mark.parametrize("nd", [np.dtype(">f4"), np.dtype("complex64"), np.dtype("U3"), np.dtype("datetime64[s]")], ids=str)
def test_numpy_dtypes_tessera_lacks_are_refused(nd):
    with pytest.raises(DataTypeError, match="has no tessera equivalent"):
        from_numpy_dtype(nd)


# ---- torch ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dt", TORCH_DTYPES, ids=str)
def test_torch_round_trip(dt):
    torch = pytest.importorskip("torch")
    t = getattr(torch, torch_name(dt))
    assert isinstance(t, torch.dtype) and t.itemsize == dt.nbytes
    assert t.is_floating_point == dt.is_float and t.is_signed == (dt.is_signed and not dt.is_bool)
    assert from_torch(t) is dt and from_torch(str(t)) is dt


def test_every_torch_dtype_maps_to_its_own_name_or_nothing():
    torch = pytest.importorskip("torch")
    seen = set()
    for name in dir(torch):
        t = getattr(torch, name)
        if not isinstance(t, torch.dtype):
            continue
        dt = from_torch(t)  # aliases (half, long, ...) print as their canonical name
        if dt is not None:
            assert getattr(torch, torch_name(dt)) == t
            seen.add(dt)
    assert seen == set(TORCH_DTYPES)
    assert from_torch(torch.half) is f16 and from_torch(torch.long) is i64 and from_torch(torch.bool) is boolean
    for t in (torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2, torch.uint4, torch.qint8):
        assert from_torch(t) is None


def test_storage_types_have_no_torch_counterpart():
    for dt in set(ALL_DTYPES) - set(TORCH_DTYPES):
        with pytest.raises(DataTypeError, match=f"no torch dtype holds {dt.name}"):
            torch_name(dt)


def test_torch_and_numpy_agree():
    torch = pytest.importorskip("torch")
    pytest.importorskip("ml_dtypes")
    for dt in set(TORCH_DTYPES) & set(NUMPY_DTYPES):
        t = torch.zeros(3, dtype=getattr(torch, torch_name(dt)))
        if dt != bf16:  # torch has no numpy view of bfloat16
            assert t.numpy().dtype == numpy_dtype(dt)


# ---- ONNX -------------------------------------------------------------------------------------
def test_onnx_round_trip():
    assert len(set(ONNX_ELEMENT_TYPES.values())) == len(ONNX_ELEMENT_TYPES)
    for code, dt in ONNX_ELEMENT_TYPES.items():
        assert onnx_element_type(dt) == code
    for dt in set(ALL_DTYPES) - set(ONNX_ELEMENT_TYPES.values()):
        with pytest.raises(DataTypeError):
            onnx_element_type(dt)


def test_onnx_table_matches_onnx():
    onnx = pytest.importorskip("onnx")
    renamed = {"FLOAT": "float32", "DOUBLE": "float64"}
    for code, dt in ONNX_ELEMENT_TYPES.items():
        name = onnx.TensorProto.DataType.Name(code)
        assert renamed.get(name, name.lower()) == dt.name


def test_onnx_importer_reads_the_one_table():
    pytest.importorskip("onnx")
    from tessera.frontend.onnx import ONNX_DTYPES

    assert ONNX_DTYPES == {code: dt.name for code, dt in ONNX_ELEMENT_TYPES.items()}


# ---- promotion policies -----------------------------------------------------------------------
@pytest.mark.parametrize("a, b, want", [
    (i8, u8, i32), (i16, i16, i16), (i32, u32, u32), (i64, u32, i64), (u64, i64, u64), (u8, u16, i32),
    (boolean, boolean, i32), (boolean, i8, i32), (f16, bf16, f32), (i64, f16, f16), (f32, f64, f64),
    (int4, int4, i32), (uint4, i8, i32), (e4m3, f16, f32), (e4m3, e4m3, f32),
])  # fmt: skip
def test_promote_is_c_arithmetic(a, b, want):
    assert promote(a, b) == want and promote(b, a) == want


@pytest.mark.parametrize("a, b, want", [
    (boolean, boolean, boolean), (boolean, i8, i32), (i8, i8, i8), (i8, u8, i32), (u32, i32, u32),
    (f16, bf16, f32), (boolean, f16, f16), (i64, f32, f32),
])  # fmt: skip
def test_promote_graph_keeps_two_bools_bool(a, b, want):
    assert promote_graph(a, b) == want and promote_graph(b, a) == want


@pytest.mark.parametrize("a, b, want", [
    (boolean, boolean, boolean), (boolean, u8, u8), (i8, u8, i16), (u8, i16, i16), (i32, u32, i64),
    (u16, i16, i32), (i64, f16, f16), (f16, bf16, f32), (boolean, bf16, bf16), (u32, u64, u64),
])  # fmt: skip
def test_promote_torch(a, b, want):
    assert promote_torch(a, b) == want and promote_torch(b, a) == want


def test_promote_torch_refuses_uint64_with_a_signed_integer():
    for s in (i8, i16, i32, i64):
        with pytest.raises(UnsupportedError, match="matmul: no integer type holds both"):
            promote_torch(u64, s, "matmul")


def test_promote_torch_is_torchs_where_torch_defines_one():
    torch = pytest.importorskip("torch")
    checked = 0
    for a, b in itertools.product(TORCH_DTYPES, repeat=2):
        try:
            want = torch.promote_types(getattr(torch, torch_name(a)), getattr(torch, torch_name(b)))
        except RuntimeError:  # torch defines no promotion for most uint16..uint64 pairs
            continue
        assert torch_name(promote_torch(a, b)) == str(want).removeprefix("torch."), (a, b)
        checked += 1
    assert checked > 100


def test_result_type_torch():
    assert result_type_torch([f16], ["float"]) == f16  # x_f16 * 2.0
    assert result_type_torch([i32], ["float"]) == f32  # x_int32 * 2.5
    assert result_type_torch([boolean], ["int"]) == i64
    assert result_type_torch([boolean], ["bool"]) == boolean
    assert result_type_torch([i8, u8, f16]) == f16
    assert result_type_torch([u8], ["int"]) == u8


def test_result_type_torch_is_torchs():
    torch = pytest.importorskip("torch")
    for dt in TORCH_DTYPES:
        for scalar, kind in ((2.5, "float"), (3, "int"), (True, "bool")):
            x = torch.zeros(2, dtype=getattr(torch, torch_name(dt)))
            try:
                want = torch.result_type(x, scalar)
            except RuntimeError:
                continue
            assert torch_name(result_type_torch([dt], [kind])) == str(want).removeprefix("torch."), (dt, scalar)


def test_ops_and_graph_use_the_policies():
    from tessera.ops.common import promote_types

    assert promote_types is dtypes.promote_torch
