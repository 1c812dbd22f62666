"""The `models` benchmark suite (bench/models_suite.py, bench/models_report.py): what runs
without a GPU -- arguments, failure capture, the subprocess bookkeeping, the JSONL and markdown
writers on synthetic rows -- plus a GPU-tier check of one system's measurement on a small model."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import models_report as mr  # noqa: E402
import models_suite as ms  # noqa: E402


# ---- arguments --------------------------------------------------------------------------------
def test_defaults_skip_max_autotune_with_reason():
    opts = ms.parse_args([])
    assert opts.models == list(ms.MODELS)
    assert opts.peers == ["torch.eager", "torch.eager+cudagraph", "torch.compile:default", "torch.compile:reduce-overhead"]
    skipped = ms.skipped_systems(opts)
    assert list(skipped) == ["torch.compile:max-autotune"]
    assert "238 s" in skipped["torch.compile:max-autotune"]
    assert opts.repeats >= 50


def test_selection_order_all_and_no_tessera():
    opts = ms.parse_args(["--models", "gpt2,resnet50", "--peers", "all", "--no-tessera"])
    assert opts.models == ["resnet50", "gpt2"]  # MODELS' order, not the command line's
    assert opts.peers == mr.PEERS
    assert ms.skipped_systems(opts) == {"tessera": "--no-tessera"}
    opts = ms.parse_args(["--peers", "torch.compile:default"])
    assert set(ms.skipped_systems(opts)) == {"torch.eager", "torch.eager+cudagraph", "torch.compile:reduce-overhead",
                                             "torch.compile:max-autotune"}  # fmt: skip


@pytest.mark.parametrize("argv", [["--peers", "inductor"], ["--models", "resnet"], ["--repeats", "0"],
                                  ["--child", "gpt2"], ["--models", ","]])  # fmt: skip
def test_bad_arguments_exit_with_usage(argv, capsys):
    with pytest.raises(SystemExit) as e:
        ms.parse_args(argv)
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err


def test_case_strings_follow_the_results_format():
    for spec in ms.MODELS.values():
        pairs = spec.case.split(",")
        assert pairs[0].startswith("model=") and pairs[-1] == "fp16"
        assert all("=" in p for p in pairs[:-1])
    assert ms.MODELS["resnet50"].case == "model=resnet50,bs=1,fp16"


@pytest.mark.parametrize("extra", [[], ["--peers", ""], ["--peers", "all", "--no-tessera"]])
def test_child_command_line_round_trips(tmp_path, extra):
    opts = ms.parse_args(["--repeats", "20", "--system-timeout", "60", "--max-call-s", "0.5", *extra])
    argv = ms.child_argv(opts, "bert", tmp_path / "row.json")
    assert argv[0] == sys.executable and argv[1].endswith("models_suite.py")
    child = ms.parse_args(argv[2:])
    assert child.child == "bert" and child.child_out == str(tmp_path / "row.json")
    assert (child.peers, child.no_tessera, child.repeats) == (opts.peers, opts.no_tessera, 20)
    assert (child.system_timeout, child.max_call_s) == (60.0, 0.5)
    assert ms.skipped_systems(child) == ms.skipped_systems(opts)


# ---- failure capture --------------------------------------------------------------------------
def test_guarded_records_the_error_and_keeps_partial_results():
    def body(res):
        res["compile_s_cold"] = 1.5
        raise ValueError("no rule for aten.foo\n  second line")

    res = ms.guarded(body)
    assert res["compile_s_cold"] == 1.5
    assert res["error"] == "ValueError: no rule for aten.foo second line"
    assert ms.guarded(lambda res: res.update(us=3.0)) == {"us": 3.0}


def test_error_text_is_one_bounded_line():
    text = ms.error_text(RuntimeError("x" * 5000 + "\n" + "y"), limit=100)
    assert len(text) == 100 and "\n" not in text and text.startswith("RuntimeError: x")


def test_alarm_turns_a_hang_into_an_error():
    def body(res):
        with ms.alarm(0.2):
            time.sleep(5)

    t0 = time.perf_counter()
    res = ms.guarded(body)
    assert time.perf_counter() - t0 < 3
    assert res["error"].startswith("SystemTimeout")
    with ms.alarm(0):  # no limit
        pass


@pytest.mark.parametrize("graphs,breaks,eager,messages,expect", [
    (1, 0, 0, [], None),
    (None, 0, 0, [], None),
    (3, 2, 0, [], "dynamo split the model into 3 graphs (2 graph breaks)"),
    (1, 0, 4, ["tessera: graph break at getitem (x): no rule"], "4 nodes ran in torch"),
    (1, 0, 0, ["tessera: running the whole graph in torch: UnsupportedError: bf16"], "1 graphs ran wholly in torch"),
    (0, 0, 0, [], "received no graph"),
])  # fmt: skip
def test_graph_break_error(graphs, breaks, eager, messages, expect):
    text = ms.graph_break_error(graphs, breaks, eager, messages)
    if expect is None:
        assert text is None
    else:
        assert text.startswith("graph break: ") and expect in text
        assert all(" ".join(m.split()).removeprefix("tessera: ") in text for m in messages)


def test_graph_break_error_puts_whole_graph_fallbacks_first():
    messages = ["tessera: graph break at eq (method.__eq__): not supported; it runs in torch",
                "tessera: running the whole graph in torch: ModuleNotFoundError: No module named 'x'"]  # fmt: skip
    text = ms.graph_break_error(1, 0, 1, messages)
    assert text.index("ModuleNotFoundError") < text.index("graph break at eq")
    assert "tessera: " not in text


def test_output_errors():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(4, 33, generator=g)
    out = ref + 1e-3 * torch.randn(4, 33, generator=g)
    rel, mx, note = ms.output_errors(out, ref)
    assert note is None and 1e-4 < rel < 1e-2 and 1e-4 < mx < 1e-2
    assert ms.output_errors(ref, ref)[:2] == (0.0, 0.0)
    bad = out.clone()
    bad[1, 2] = float("nan")
    assert ms.output_errors(bad, ref) == (None, None, "non-finite values in the output")
    assert ms.output_errors(out[:, :5], ref)[2].startswith("output shape")


def test_compile_kwargs():
    assert ms.compile_kwargs("tessera") == {"backend": "tessera"}
    assert ms.compile_kwargs("torch.compile:default") == {}
    assert ms.compile_kwargs("torch.compile:max-autotune") == {"mode": "max-autotune"}


# ---- results ----------------------------------------------------------------------------------
ENV = {"gpu": "NVIDIA H200", "date": "2026-11-23", "commit": "0123456789abcdef", "torch": "2.11.0",
       "cuda": "13.0", "repeats": 50}  # fmt: skip


def synthetic_row(case: str, tessera_us: float | None = 800.0) -> dict:
    row = {**mr.new_row(case), **ENV}
    row["skipped"] = {"torch.compile:max-autotune": ms.SLOW_PEER_REASON}
    mr.record(row, "torch.eager", {"us": 5620.0, "rel_err": 2e-3, "max_err": 4e-3})
    mr.record(row, "torch.compile:default", {"us": 3780.0, "compile_s_cold": 41.0, "compile_s_warm": 6.0,
                                             "rel_err": 2.1e-3, "graph_breaks": 0})  # fmt: skip
    mr.record(row, "torch.compile:reduce-overhead", {"error": "RuntimeError: cudagraph | failed"})
    if tessera_us is None:
        mr.record(row, "tessera", {"compile_s_cold": 90.0, "error": "graph break: 2 nodes ran in torch",
                                   "extra": {"tessera_us_with_breaks": 9000.0}})  # fmt: skip
    else:
        mr.record(row, "tessera", {"us": tessera_us, "compile_s_cold": 90.0, "compile_s_warm": 3.0,
                                   "rel_err": 1e-3, "max_err": 2e-3, "graph_breaks": 0})  # fmt: skip
    return mr.summarize(row)


def test_record_and_summarize():
    row = synthetic_row("model=gpt2,bs=1,seq=128,fp16")
    assert row["tessera_us"] == 800.0 and row["compile_s_cold"] == 90.0 and row["rel_err"] == 1e-3
    assert row["peers_us"] == {"torch.eager": 5620.0, "torch.compile:default": 3780.0}
    assert row["peers_compile_s_cold"] == {"torch.compile:default": 41.0}
    assert row["errors"] == {"torch.compile:reduce-overhead": "RuntimeError: cudagraph | failed"}
    assert row["best_compile_peer"] == "torch.compile:default"  # eager is no torch.compile mode
    assert row["vs_best_compile"] == pytest.approx(3780.0 / 800.0)
    assert row["vs_eager"] == pytest.approx(5620.0 / 800.0)
    broken = synthetic_row("model=bert-base,bs=1,seq=128,fp16", tessera_us=None)
    assert broken["tessera_us"] is None and broken["vs_best_compile"] is None
    assert broken["tessera_us_with_breaks"] == 9000.0 and "tessera" in broken["errors"]


def test_jsonl_has_the_results_format_and_appends(tmp_path):
    path = tmp_path / f"{mr.stem(ENV)}.jsonl"
    assert path.name == "2026-11-23-h200-models.jsonl"
    mr.append_jsonl(path, [synthetic_row("model=resnet50,bs=1,fp16")])
    row = synthetic_row("model=gpt2,bs=1,seq=128,fp16")
    row["rel_err"] = float("nan")  # JSON has no NaN: written as null
    mr.append_jsonl(path, [row])
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    for line in lines:
        obj = json.loads(line)
        for key in ("suite", "case", "tessera_us", "peers_us", "rel_err", "gpu", "date", "commit",
                    "compile_s_cold", "compile_s_warm"):  # fmt: skip
            assert key in obj
        assert obj["suite"] == "models"
    assert json.loads(lines[1])["rel_err"] is None


def test_markdown_table(tmp_path):
    rows = [synthetic_row("model=resnet50,bs=1,fp16", 1000.0), synthetic_row("model=gpt2,bs=1,seq=128,fp16"),
            synthetic_row("model=bert-base,bs=1,seq=128,fp16", tessera_us=None),
            synthetic_row("model=resnet50,bs=1,fp16", 500.0)]  # fmt: skip
    md = mr.render_markdown(rows)
    table = [line for line in md.splitlines() if line.startswith("| model=")]
    latency = table[:3]
    assert [t.split(" | ")[0] for t in latency] == ["| model=resnet50,bs=1,fp16", "| model=gpt2,bs=1,seq=128,fp16",
                                                   "| model=bert-base,bs=1,seq=128,fp16"]  # fmt: skip
    assert "| 0.500 |" in latency[0] and "| 7.56 |" in latency[0]  # the later resnet50 row wins: 3780 / 500
    assert "| 1.000 |" not in md
    assert latency[2].startswith("| model=bert-base,bs=1,seq=128,fp16 | error |")
    assert latency[1].count("| skipped |") == 1 and latency[1].count("| error |") == 1
    assert "RuntimeError: cudagraph \\| failed" in md  # pipes escaped inside cells
    assert "238 s" in md and "No L2 flush" in md and "commit 0123456789ab" in md
    assert mr.render_markdown([]).startswith("# models: no results")


def test_host_time_per_call_is_recorded_and_shown_for_every_system():
    row = mr.new_row("model=resnet50,bs=1,fp16")
    mr.record(row, "tessera", {"us": 250.0, "host_us": 240.0, "compile_s_cold": 38.0})
    mr.record(row, "torch.eager", {"us": 4000.0, "host_us": 3900.0})
    row = mr.summarize({**row, **ENV})
    assert row["host_us"] == {"tessera": 240.0, "torch.eager": 3900.0}
    lines = {line.split(" | ")[1]: line for line in mr.render_markdown([row]).splitlines()
             if line.startswith("| model=resnet50,bs=1,fp16 | ") and " | host" not in line}  # fmt: skip
    assert "| 38.0 | – | 240 |" in lines["tessera"] and "| 3900 |" in lines["torch.eager"]


def decode_row(case: str = "model=llama-1.1b-decode,bs=1,kv=512,fp16") -> dict:
    import decode_case as dc

    row = {**mr.new_row(case), **ENV, "kv": 512, "floor_us": 520.0, "copy_gbs": 4220.0,
           "bytes_per_token": {"weights": 2_150_000_000, "kv_cache": 11_534_336, "total": 2_161_534_336},
           "pct_of_floor": {}, "argmax_agree": {}}  # fmt: skip
    dc.record_decode(row, "torch.eager", {"us": 2080.0, "rel_err": 0.0, "argmax_agree": "4/4"})
    dc.record_decode(row, "torch.compile:reduce-overhead", {"us": 650.0, "rel_err": 1e-3, "argmax_agree": "4/4"})
    dc.record_decode(row, "tessera", {"us": 700.0, "rel_err": 2e-3, "argmax_agree": "3/4", "host_us": 655.0})
    dc.record_decode(row, "torch.compile:default", {"error": "RuntimeError: boom"})
    return mr.summarize(row)


def test_decode_rows_report_the_floor():
    row = decode_row()
    assert row["pct_of_floor"] == pytest.approx({"torch.eager": 25.0, "torch.compile:reduce-overhead": 80.0,
                                                 "tessera": 520.0 / 7.0})  # fmt: skip
    assert row["argmax_agree"]["tessera"] == "3/4" and row["tessera_us"] == 700.0
    md = mr.render_markdown([synthetic_row("model=gpt2,bs=1,seq=128,fp16"), row])
    (line,) = [x for x in md.splitlines() if x.startswith("| model=llama-1.1b-decode") and "% " not in x
               and "| 0.520 |" in x]  # fmt: skip
    cells = line.split(" | ")
    assert cells[2] == "2161.5" and cells[3] == "4220"  # MB read per token, copy GB/s
    assert "| 25 |" in line and "| 80 |" in line and "| 74 |" in line  # eager, reduce-overhead, tessera
    assert "tessera 3/4" in line and "| 655 |" in line and row["host_us"] == {"tessera": 655.0}
    assert "gpt2" not in md.split("## Decode")[1].split("## Compile")[0]  # only decode rows in that table
    # a later run of a subset at the same commit keeps the other systems' floor entries
    subset = {**mr.new_row(row["case"]), **ENV, "kv": 512, "floor_us": 520.0, "pct_of_floor": {}, "argmax_agree": {}}
    subset["skipped"] = {s: "not in --peers" for s in mr.SYSTEMS if s != "tessera"}
    import decode_case as dc

    dc.record_decode(subset, "tessera", {"us": 650.0, "argmax_agree": "4/4"})
    (merged,) = mr.latest_per_case([row, mr.summarize(subset)])
    assert merged["pct_of_floor"]["torch.eager"] == pytest.approx(25.0)
    assert merged["pct_of_floor"]["tessera"] == pytest.approx(80.0) and merged["argmax_agree"]["tessera"] == "4/4"


def test_decode_cases_are_models_of_the_suite():
    specs = [ms.MODELS[m] for m in ("llama-decode-512", "llama-decode-2048")]
    assert [s.kv for s in specs] == [512, 2048] and all(s.family == "llama" for s in specs)
    assert ms.parse_args(["--models", "llama-decode-2048"]).models == ["llama-decode-2048"]


@pytest.mark.slow
def test_decode_case_runs_end_to_end_on_a_tiny_llama():
    """The decode case's code path on the CPU: a tiny float32 Llama, eager and tessera; tessera's
    steps (4 different tokens) agree with eager's, and the timed steps ran."""
    pytest.importorskip("transformers")
    import argparse

    import decode_case as dc

    opts = argparse.Namespace(repeats=3, warmup=1, system_timeout=600.0, max_call_s=60.0)
    row = mr.new_row("model=llama-tiny-decode,bs=1,kv=20,fp32")
    dc.run_decode(row, ["torch.eager", "tessera"], 20, opts, device="cpu", tiny=True)
    assert row["errors"] == {}, row["errors"]
    assert row["tessera_us"] > 0 and row["peers_us"]["torch.eager"] > 0
    assert row["rel_err"] < 1e-4 and row["argmax_agree"] == {"torch.eager": "4/4", "tessera": "4/4"}
    assert row["peers_rel_err"]["torch.eager"] == 0.0  # eager against itself: the steps are replayed exactly
    assert row["bytes_per_token"]["kv_cache"] == 2 * 2 * 2 * 20 * 16 * 4  # K and V, layers, kv heads, kv, dim, fp32
    assert row["floor_us"] == pytest.approx(row["bytes_per_token"]["total"] / (row["copy_gbs"] * 1e9) * 1e6)
    assert row["tessera_graph"]["eager_nodes"] == 0
    assert set(row["host_us"]) == {"torch.eager", "tessera"} and all(v > 0 for v in row["host_us"].values())


def test_runs_of_one_commit_merge_and_a_new_commit_supersedes():
    base = synthetic_row("model=resnet50,bs=1,fp16", 700.0)
    autotune = {**mr.new_row("model=resnet50,bs=1,fp16"), **ENV}
    autotune["skipped"] = {s: "not in --peers" for s in mr.SYSTEMS if s != "torch.compile:max-autotune"}
    mr.record(autotune, "torch.compile:max-autotune", {"us": 650.0, "compile_s_cold": 238.0, "rel_err": 2e-3})
    (row,) = mr.latest_per_case([base, mr.summarize(autotune)])
    assert row["peers_us"] == {"torch.eager": 5620.0, "torch.compile:default": 3780.0,
                               "torch.compile:max-autotune": 650.0}  # fmt: skip
    assert row["tessera_us"] == 700.0 and row["compile_s_cold"] == 90.0
    assert row["errors"] == {"torch.compile:reduce-overhead": "RuntimeError: cudagraph | failed"}
    assert row["best_compile_peer"] == "torch.compile:max-autotune" and row["vs_best_compile"] == pytest.approx(650 / 700)
    assert row["peers_compile_s_cold"]["torch.compile:max-autotune"] == 238.0 and not row["skipped"]
    later = {**synthetic_row("model=resnet50,bs=1,fp16", 600.0), "commit": "fedcba9876543210"}
    (row,) = mr.latest_per_case([base, mr.summarize(autotune), later])
    assert row["tessera_us"] == 600.0 and "torch.compile:max-autotune" not in row["peers_us"]


# ---- the subprocess bookkeeping ---------------------------------------------------------------
def _fake_child(script: str):
    """A command line for run_model: python running `script`, with the row file as argv[1]."""
    return lambda path: [sys.executable, "-c", textwrap.dedent(script), str(path)]


def test_crashed_child_records_every_system(tmp_path):
    opts = ms.parse_args(["--out", str(tmp_path)])
    row = ms.run_model(opts, "gpt2", _fake_child("import sys; sys.exit(3)"))
    assert row["case"] == "model=gpt2,bs=1,seq=128,fp16" and row["model"] == "gpt2"
    assert set(row["errors"]) == {"torch.eager", "torch.eager+cudagraph", "torch.compile:default",
                                  "torch.compile:reduce-overhead", "tessera"}  # fmt: skip
    assert all("exited with code 3" in e for e in row["errors"].values())
    assert "torch.compile:max-autotune" in row["skipped"]
    assert row["date"] and row["commit"]


def test_partial_child_keeps_finished_systems(tmp_path):
    opts = ms.parse_args(["--peers", "torch.eager,torch.compile:default"])
    row = mr.new_row(ms.MODELS["bert"].case)
    mr.record(row, "torch.eager", {"us": 7000.0, "rel_err": 1e-3})
    script = f"""
        import json, sys, os
        open(sys.argv[1], "w").write({json.dumps(row)!r})
        assert os.environ["TESSERA_CACHE_DIR"].endswith("/tessera")  # a fresh folder per model
        os.kill(os.getpid(), 9)
    """
    out = ms.run_model(opts, "bert", _fake_child(script))
    assert out["peers_us"] == {"torch.eager": 7000.0}
    assert set(out["errors"]) == {"torch.compile:default", "tessera"}
    assert "code -9" in out["errors"]["tessera"]


def test_hung_child_is_killed(tmp_path):
    opts = ms.parse_args(["--model-timeout", "1"])
    t0 = time.perf_counter()
    row = ms.run_model(opts, "resnet50", _fake_child("import time; time.sleep(60)"))
    assert time.perf_counter() - t0 < 20
    assert all("--model-timeout" in e for e in row["errors"].values())


@pytest.mark.slow
def test_suite_appends_rows_and_rewrites_markdown(tmp_path, monkeypatch):
    row = synthetic_row("placeholder")
    script = """
        import json, sys
        row = json.loads(sys.argv[2]); row["case"] = sys.argv[3]
        json.dump(row, open(sys.argv[1], "w"))
    """
    monkeypatch.setattr(
        ms,
        "child_argv",
        lambda opts, model, path: [
            sys.executable,
            "-c",
            textwrap.dedent(script),
            str(path),
            json.dumps(row),
            ms.MODELS[model].case,
        ],
    )
    ms.run_suite(ms.parse_args(["--models", "gpt2", "--out", str(tmp_path)]))
    ms.run_suite(ms.parse_args(["--models", "resnet50,bert", "--out", str(tmp_path)]))
    (jsonl,) = tmp_path.glob("*-models.jsonl")
    assert [json.loads(x)["case"] for x in jsonl.read_text().splitlines()] == [
        ms.MODELS[m].case for m in ("gpt2", "resnet50", "bert")]  # fmt: skip
    md = jsonl.with_suffix(".md").read_text()
    assert all(ms.MODELS[m].case in md for m in ("gpt2", "resnet50", "bert"))


@pytest.mark.slow
def test_run_py_routes_the_models_suite():
    """bench/run.py --suite models hands its own options to models_suite (bad ones exit with usage)."""
    proc = subprocess.run([sys.executable, str(BENCH / "run.py"), "--suite", "models", "--models", "nope"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and "unknown model(s) nope" in proc.stderr


# ---- GPU tier ---------------------------------------------------------------------------------
@pytest.mark.cuda
def test_measure_eager_and_compile_on_a_small_model():
    pytest.importorskip("triton")
    from harness import Timer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(96, 160), torch.nn.GELU(), torch.nn.Linear(160, 33))
    model = model.cuda().half().eval()
    inputs = (torch.randn(7, 96, device="cuda", dtype=torch.float16),)
    opts = ms.parse_args(["--repeats", "5", "--warmup", "2", "--system-timeout", "300"])
    with torch.no_grad():
        ref = ms.reference(model, inputs)
        timer = Timer(repeats=5, warmup=2, flush_l2=False)
        for system in ("torch.eager", "torch.eager+cudagraph", "torch.compile:default"):
            res = ms.measure(system, model, inputs, ref, timer, opts)
            assert "error" not in res, res
            assert res["us"] > 0 and res["rel_err"] < 1e-2 and res["host_us"] > 0
            if system.startswith("torch.compile"):
                assert res["compile_s_cold"] > 0 and res["compile_s_warm"] > 0 and res["graph_breaks"] == 0
