"""Task-mapping semantics: TaskMapping vs an independent brute-force reference, and the lowered C loops."""

from __future__ import annotations

import itertools
import random
from collections import Counter
from math import prod

import numpy as np
import pytest

import tessera as ts
from tessera import i32
from tessera.transforms.lower_task_mapping import UNROLL_LIMIT

# Kernel parameter types (string dimension names, kept out of annotations for the linter).
OUT3 = i32["n0", "n1", "n2"]
OUT1 = i32["n"]

# ---- reference semantics (Hidet), written independently of tessera.ir.mapping --------------------
# A reference mapping is (num_workers, task_shape, tasks) where tasks(w) lists worker w's tasks in order.


def ref_atom(kind, shape, ranks):
    rank = len(shape)
    ranks = list(range(rank)) if ranks is None else list(ranks)
    # ranks[d] is dimension d's position in row-major order: higher rank = faster varying.
    strides = [prod(shape[e] for e in range(rank) if ranks[e] > ranks[d]) for d in range(rank)]

    def coords(x):
        return tuple(x // strides[d] % shape[d] for d in range(rank))

    if kind == "spatial":
        return prod(shape), tuple(shape), lambda w: [coords(w)]
    return 1, tuple(shape), lambda w: [coords(x) for x in range(prod(shape))]


def ref_compose(f, g):
    fn, fshape, ftasks = f
    gn, gshape, gtasks = g

    def tasks(w):
        return [tuple(a * s + b for a, s, b in zip(ft, gshape, gt)) for ft in ftasks(w // gn) for gt in gtasks(w % gn)]

    return fn * gn, tuple(a * b for a, b in zip(fshape, gshape)), tasks


def random_atoms(rng, rank, n):
    atoms = []
    for _ in range(n):
        kind = rng.choice(["spatial", "repeat"])
        shape = tuple(rng.randint(1, 3) for _ in range(rank))
        ranks = None if rng.random() < 0.4 else rng.sample(range(rank), rank)
        atoms.append((kind, shape, ranks))
    return atoms


def build(rng, atoms):
    """(TaskMapping, reference): composed as a random binary tree of `*` to exercise associativity."""
    if len(atoms) == 1:
        kind, shape, ranks = atoms[0]
        return getattr(ts, kind)(*shape, ranks=ranks), ref_atom(kind, shape, ranks)
    k = rng.randint(1, len(atoms) - 1)
    (lm, lr), (rm, rr) = build(rng, atoms[:k]), build(rng, atoms[k:])
    return lm * rm, ref_compose(lr, rr)


def random_mapping(rng, max_total=1500):
    while True:
        rank = rng.randint(1, 3)
        m, ref = build(rng, random_atoms(rng, rank, rng.randint(1, 4)))
        if m.num_workers * m.tasks_per_worker <= max_total:
            return m, ref


# ---- Python semantics ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(150))
def test_random_mapping_matches_reference(seed):
    rng = random.Random(seed)
    m, (nw, shape, tasks) = random_mapping(rng, max_total=4000)
    assert m.num_workers == nw
    assert m.task_shape == shape
    per_worker = [m.worker_tasks(w) for w in range(nw)]
    assert per_worker == [tasks(w) for w in range(nw)]
    assert all(len(t) == m.tasks_per_worker for t in per_worker)
    assert [m.on(w) for w in range(nw)] == per_worker
    assert list(m) == [t for ts_ in per_worker for t in ts_]
    # Spatial/repeat compositions cover every task of the grid exactly once.
    counts = Counter(t for ts_ in per_worker for t in ts_)
    assert set(counts.values()) == {1}
    assert set(counts) == set(itertools.product(*(range(s) for s in shape)))
    # repr round-trips (associativity of `*` is covered by the random composition tree in build()).
    assert eval(repr(m), {"spatial": ts.spatial, "repeat": ts.repeat}) == m


@pytest.mark.parametrize(
    ("m", "expected"),
    [
        (ts.spatial(4, 8), [[(w // 8, w % 8)] for w in range(32)]),
        (ts.spatial(2, 3, ranks=[1, 0]), [[(0, 0)], [(1, 0)], [(0, 1)], [(1, 1)], [(0, 2)], [(1, 2)]]),
        (ts.repeat(2, 2), [[(0, 0), (0, 1), (1, 0), (1, 1)]]),
        (ts.repeat(2, 2, ranks=[1, 0]), [[(0, 0), (1, 0), (0, 1), (1, 1)]]),
        (ts.spatial(2) * ts.repeat(2), [[(0,), (1,)], [(2,), (3,)]]),
        (ts.repeat(2) * ts.spatial(2), [[(0,), (2,)], [(1,), (3,)]]),
        (ts.spatial(2, 1) * ts.spatial(1, 2), [[(0, 0)], [(0, 1)], [(1, 0)], [(1, 1)]]),
        (
            ts.spatial(3, 1, 2, ranks=[2, 0, 1]),
            [[(0, 0, 0)], [(1, 0, 0)], [(2, 0, 0)], [(0, 0, 1)], [(1, 0, 1)], [(2, 0, 1)]],
        ),
    ],
)
def test_known_mappings(m, expected):
    assert [m.worker_tasks(w) for w in range(m.num_workers)] == expected


def test_mapping_properties():
    m = ts.spatial(4, 2) * ts.repeat(2, 3) * ts.spatial(1, 8)
    assert (m.num_workers, m.task_shape, m.tasks_per_worker, m.rank) == (64, (8, 48), 6, 2)
    assert m == ts.spatial(4, 2) * (ts.repeat(2, 3) * ts.spatial(1, 8)) and hash(m) == hash(eval(repr(m), vars(ts)))
    assert repr(ts.spatial(2, 3, ranks=[1, 0]) * ts.repeat(4, 1)) == "spatial(2, 3, ranks=[1, 0]) * repeat(4, 1)"


# ---- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda: ts.spatial(2) * ts.spatial(2, 3),
        lambda: ts.repeat(2, 2, 2) * ts.spatial(2, 3),
        lambda: ts.TaskMapping([]),
        lambda: ts.spatial(),
        lambda: ts.repeat(),
        lambda: ts.spatial(0, 2),
        lambda: ts.repeat(2, -1),
        lambda: ts.spatial(2.0),
        lambda: ts.spatial(True),
        lambda: ts.spatial(2, 3, ranks=[0, 0]),
        lambda: ts.spatial(2, 3, ranks=[1, 2]),
        lambda: ts.repeat(2, 3, ranks=[0]),
        lambda: ts.repeat(2, ranks=[0, 1]),
    ],
)
def test_invalid_mappings_raise(make):
    with pytest.raises(ValueError):
        make()


def test_worker_out_of_range_and_misuse():
    m = ts.spatial(2, 3) * ts.repeat(2, 1)
    for w in (-1, 6, 100):
        with pytest.raises(IndexError):
            m.worker_tasks(w)
        with pytest.raises(IndexError):
            m.on(w)
    with pytest.raises(TypeError):
        m.on("w")
    with pytest.raises(TypeError):
        m * 2


# ---- lowering through gcc ----------------------------------------------------------------------


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path / "cache"))


def tasks_kernel(m):
    """A CPU kernel writing out[w, t, :] = coordinates of worker w's t-th task of `m`."""
    nw, rank = m.num_workers, m.rank

    @ts.kernel
    def tasks(out: OUT3):
        for w in range(nw):
            t = 0
            if rank == 1:
                for i in m.on(w):
                    out[w, t, 0] = i
                    t += 1
            elif rank == 2:
                for i, j in m.on(w):
                    out[w, t, 0] = i
                    out[w, t, 1] = j
                    t += 1
            else:
                for i, j, k in m.on(w):
                    out[w, t, 0] = i
                    out[w, t, 1] = j
                    out[w, t, 2] = k
                    t += 1

    return tasks


def check_lowered(m):
    k = tasks_kernel(m)
    assert f"({m!r}).on(w)" in str(k.ir)
    assert ".on(" not in str(k.lowered)
    out = np.full((m.num_workers, m.tasks_per_worker, m.rank), -1, dtype=np.int32)
    k(out)
    expected = np.array([m.worker_tasks(w) for w in range(m.num_workers)], dtype=np.int32)
    np.testing.assert_array_equal(out, expected.reshape(out.shape))


@pytest.mark.parametrize("seed", range(8))
def test_lowered_random_mapping(seed):
    check_lowered(random_mapping(random.Random(1000 + seed))[0])


@pytest.mark.parametrize(
    "m",
    [
        ts.spatial(4, 8),
        ts.spatial(2, 3, ranks=[1, 0]) * ts.repeat(2, 2) * ts.spatial(1, 2),
        ts.repeat(2, 3) * ts.spatial(3, 2, ranks=[1, 0]) * ts.repeat(1, 2, ranks=[1, 0]),
        ts.repeat(3, 5) * ts.spatial(2, 2) * ts.repeat(5, 1),  # more tasks than UNROLL_LIMIT: serial loops
        ts.spatial(2, 1, 3, ranks=[2, 0, 1]) * ts.repeat(2, 1, 2, ranks=[1, 2, 0]) * ts.spatial(1, 2, 1),
        ts.spatial(5) * ts.repeat(3) * ts.spatial(2) * ts.repeat(2),
    ],
    ids=repr,
)
def test_lowered_fixed_mapping(m):
    check_lowered(m)


def test_serial_case_exceeds_unroll_limit():
    assert (ts.repeat(3, 5) * ts.spatial(2, 2) * ts.repeat(5, 1)).tasks_per_worker > UNROLL_LIMIT


def test_ir_printer_shows_mapping():
    m = ts.spatial(4, 2) * ts.repeat(2, 2)
    k = tasks_kernel(m)
    text = str(k.ir)
    assert "spatial(" in text and "for i, j in (spatial(4, 2) * repeat(2, 2)).on(w):" in text


def test_kernel_rank_mismatch_is_syntax_error():
    m = ts.spatial(2, 2)

    def bad(out: OUT1):
        for i in m.on(0):
            out[i] = 1

    with pytest.raises(ts.KernelSyntaxError, match="rank 2"):
        ts.kernel(bad)
