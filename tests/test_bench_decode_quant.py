"""The quantized decode cases of the models suite (bench/decode_case.py with a WeightSpec): a
tiny Llama quantized by tessera.quantize, run on the CPU through the tessera backend, its row's
fields checked against an independent count of the bytes a step reads; bad weight specs refused."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import pytest

from tessera.errors import ArgumentError

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import decode_case as dc  # noqa: E402
import models_report as mr  # noqa: E402
import models_suite as ms  # noqa: E402


def expected_bytes(bits: int | None, group: int, kv: int, elem: int = 4) -> dict[str, int]:
    """Bytes one step of dynamic_suite's tiny Llama reads (hidden 64, intermediate 96, 2 layers,
    4 heads, 2 KV heads of 16, vocab 1000): its decoder linears at `bits` with a float16 scale per
    `group` inputs (bits None: unquantized), everything else `elem` bytes an element."""
    hidden, inter, layers, heads, kv_heads, vocab = 64, 96, 2, 4, 2, 1000
    head = hidden // heads
    linears = [(hidden, hidden), (kv_heads * head, hidden), (kv_heads * head, hidden), (hidden, hidden),
               (inter, hidden), (inter, hidden), (hidden, inter)]  # q k v o gate up down: [N, K]  # fmt: skip
    if bits is None:
        per_layer = sum(n * k * elem for n, k in linears)
    else:
        per_layer = sum(math.ceil(n * k * bits / 8) + n * math.ceil(k / group) * 2 for n, k in linears)
    per_layer += 2 * hidden * elem  # the two RMS norms
    weights = layers * per_layer + hidden * elem + hidden * elem + vocab * hidden * elem  # final norm, embed row, lm_head
    cache = 2 * layers * kv_heads * kv * head * elem
    return {"weights": weights, "kv_cache": cache, "total": weights + cache}


@pytest.mark.slow
def test_quantized_decode_case_runs_on_a_tiny_llama_through_tessera():
    opts = argparse.Namespace(repeats=3, warmup=1, system_timeout=600.0, max_call_s=60.0)
    kv, spec = 20, dc.WeightSpec("int4", 32)
    row = mr.new_row(f"model=llama-tiny-decode,bs=1,kv={kv},w=int4,g=32,fp32")
    systems = ["torch.eager", mr.TESSERA_FP16, mr.TESSERA]
    dc.run_decode(row, systems, kv, opts, device="cpu", tiny=True, weights=spec)
    assert row["errors"] == {}, row["errors"]
    # what was quantized, recorded in the row
    assert (row["weight"], row["group_size"], row["zero_point"]) == ("int4", 32, False)
    assert row["quantized_linears"] == 14 and row["fp16_linears"] == ["lm_head"] and row["quantize_s"] > 0
    # latency and tokens/s of every system
    t = row["tessera_us"]
    assert t > 0 and all(row["peers_us"][s] > 0 for s in systems[:2])
    assert row["tokens_per_s"][mr.TESSERA] == pytest.approx(1e6 / t)
    # the floor: the quantized model's bytes, counted here independently
    assert row["bytes_per_token"] == expected_bytes(4, 32, kv)
    assert row["bytes_per_token_fp16"] == expected_bytes(None, 32, kv)
    assert row["copy_gbs"] > 0
    assert row["floor_us"] == pytest.approx(row["bytes_per_token"]["total"] / (row["copy_gbs"] * 1e9) * 1e6)
    assert row["floor_us_fp16"] > row["floor_us"]
    assert row["pct_of_floor"][mr.TESSERA] == pytest.approx(100 * row["floor_us"] / t)
    assert row["pct_of_floor"]["torch.eager"] == pytest.approx(100 * row["floor_us_fp16"] / row["peers_us"]["torch.eager"])
    # agreement with fp16 eager: recorded, not asserted equal for the low-bit model
    assert set(row["argmax_agree"]) == set(systems)
    assert row["argmax_agree"]["torch.eager"] == row["argmax_agree"][mr.TESSERA_FP16] == "4/4"
    assert row["argmax_agree"][mr.TESSERA] in {f"{i}/4" for i in range(5)}
    assert 1e-3 < row["rel_err"] < 2.0  # int4 weights change the logits
    assert row["peers_rel_err"][mr.TESSERA_FP16] < 1e-4
    # ...while tessera computes the quantized model itself right
    own = row["vs_quantized_eager"]
    assert own["rel_err"] < 1e-4 and own["argmax_agree"] == "4/4"
    assert row["tessera_fp16_graph"]["eager_nodes"] == 0
    assert row["tessera_graph"]["eager_nodes"] == 0  # float32 lowbit_linear: the CPU row kernel, no graph break
    assert row["tessera_graph"]["reference_ops"] == 0  # ... and not its numpy reference
    # the markdown's quantized table
    md = mr.render_markdown([mr.summarize(row)])
    (line,) = [x for x in md.split("## Quantized decode")[1].split("## Compile")[0].splitlines() if x.startswith("| model=llama-tiny")]
    assert "| int4, g32 |" in line and f"| {row['argmax_agree'][mr.TESSERA]} |" in line
    assert "## Decode:" not in md  # the fp16 decode table leaves quantized rows to their own


@pytest.mark.slow
def test_quantized_float16_decode_step_is_one_tessera_graph_of_lowbit_operators():
    """float16, as on the GPU: the quantized step compiles to one tessera graph whose linears are
    lowbit_linear operators (the GPU's anchor; on the CPU the row kernel), nothing left to torch;
    it matches eager on the quantized model, and the floor counts float16 bytes."""
    opts = argparse.Namespace(repeats=2, warmup=1, system_timeout=600.0, max_call_s=60.0)
    kv = 20
    row = mr.new_row(f"model=llama-tiny-decode,bs=1,kv={kv},w=uint3,g=16,fp16")
    dc.run_decode(row, [mr.TESSERA], kv, opts, device="cpu", tiny=True, weights=dc.WeightSpec("uint3", 16),
                  dtype=torch.float16)  # fmt: skip
    assert row["errors"] == {}, row["errors"]
    assert row["zero_point"] is True  # uint types carry zero points: read as float16 biases
    expected = expected_bytes(3, 16, kv, elem=2)
    n_groups = 2 * sum(n * math.ceil(k / 16) for n, k in ((64, 64), (32, 64), (32, 64), (64, 64), (96, 64),
                                                           (96, 64), (64, 96)))  # fmt: skip
    expected = {**expected, "weights": expected["weights"] + 2 * n_groups,
                "total": expected["total"] + 2 * n_groups}  # fmt: skip
    assert row["bytes_per_token"] == expected
    graph = row["tessera_graph"]
    assert graph["graphs"] == 1 and graph["eager_nodes"] == 0 and row["graph_breaks"][mr.TESSERA] == 0
    assert graph["reference_ops"] == 0  # every lowbit_linear on a kernel (the CPU row kernel here)
    assert "graph_break" not in row
    own = row["vs_quantized_eager"]
    assert own["rel_err"] < 1e-2 and own["argmax_agree"] == "4/4"
    assert row["tessera_us"] > 0


def test_bad_weight_specs_are_refused_clearly(capsys):
    with pytest.raises(ArgumentError, match="'int9' is not a low-bit weight type"):
        dc.WeightSpec("int9")
    with pytest.raises(ArgumentError, match="group_size must be a positive int"):
        dc.WeightSpec("int4", 0)
    with pytest.raises(SystemExit):
        dc.main(["--tiny", "--device", "cpu", "--weight", "fp4"])
    assert "'fp4' is not a low-bit weight type" in capsys.readouterr().err
    # in the suite a bad spec is a build failure every system records, not a crash
    row = mr.new_row("bad")
    dc.run_decode(row, ["torch.eager", mr.TESSERA], 20, argparse.Namespace(), device="cpu", tiny=True,
                  weights=argparse.Namespace(weight="int9", group_size=128))  # fmt: skip
    assert set(row["errors"]) == {"torch.eager", mr.TESSERA}
    assert "not a low-bit weight type" in row["errors"][mr.TESSERA]
    assert (row["weight"], row["group_size"]) == ("int9", 128)  # what it was to measure, still said


def test_quantized_cases_of_the_suite():
    quant = {name: spec for name, spec in ms.MODELS.items() if spec.weight}
    assert set(quant) == {"llama-decode-512-int4", "llama-decode-512-int3"}
    for spec in quant.values():
        dc.WeightSpec(spec.weight, spec.group_size)  # valid
        assert f"w={spec.weight},g={spec.group_size}" in spec.case and spec.kv == 512
    opts = ms.parse_args(["--models", "llama-decode-512-int4", "--peers", "torch.eager"])
    spec = ms.MODELS["llama-decode-512-int4"]
    assert spec.systems(ms.skipped_systems(opts, spec)) == ["torch.eager", mr.TESSERA_FP16, mr.TESSERA]
    no_tessera = ms.parse_args(["--no-tessera", "--peers", "all"])
    assert spec.systems(ms.skipped_systems(no_tessera, spec)) == mr.PEERS
    assert ms.MODELS["llama-decode-512"].systems({}) == mr.SYSTEMS
    assert ms.compile_kwargs(mr.TESSERA_FP16) == {"backend": "tessera"}


@pytest.mark.cuda
@pytest.mark.parametrize("weight", ["int4", "int3"])
def test_quantized_decode_case_on_the_gpu(weight):
    """The GPU path of the suite's quantized rows on the tiny Llama (float16): tessera runs the
    low-bit anchors in one graph, agrees with eager on the quantized model, and the row's floor
    uses the low-bit bytes over the measured copy bandwidth."""
    opts = argparse.Namespace(repeats=5, warmup=2, system_timeout=600.0, max_call_s=10.0)
    kv = 40
    row = mr.new_row(f"model=llama-tiny-decode,bs=1,kv={kv},w={weight},g=32,fp16")
    dc.run_decode(row, ["torch.eager", mr.TESSERA_FP16, mr.TESSERA], kv, opts, device="cuda", tiny=True,
                  weights=dc.WeightSpec(weight, 32))  # fmt: skip
    assert row["errors"] == {}, row["errors"]
    assert row["bytes_per_token"] == expected_bytes(int(weight[-1]), 32, kv, elem=2)
    assert row["floor_us"] == pytest.approx(row["bytes_per_token"]["total"] / (row["copy_gbs"] * 1e9) * 1e6)
    assert row["tessera_graph"]["eager_nodes"] == 0 and "graph_break" not in row
    assert row["tessera_graph"]["reference_ops"] == 0  # every lowbit_linear on the decode kernel
    own = row["vs_quantized_eager"]
    assert own["rel_err"] < 1e-2 and own["argmax_agree"] == "4/4"
    assert row["tessera_us"] > 0 and row["peers_us"][mr.TESSERA_FP16] > 0
