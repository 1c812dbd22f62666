"""The 1.1B Llama's prefill (one prompt, 512 tokens unless $PROMPT says) through torch.compile with int4 weights
(`tessera.quantize`, group 128, lm_head fp16) against tessera and eager on the fp16 model
(issue 12), the int4 model compiled four ways: `auto` (tuning picks per shape), `dequant`
(lowbit_linear beyond 64 rows dequantises into the arena, then runs the fp16 GEMM), `register`
(the register-A kernel on the fragment words) and `fused` (tessera.kernels.lowbit_gemm), by
$TESSERA_LOWBIT_PREFILL; $PREFILL_MODES (comma-separated, `fp16` the fp16 model) picks a
subset; $PROMPT the prompt's tokens (512).  A development measurement: CUDA events around each forward, median of 20 after 3
warm-up calls, no L2 flush (a model's weights stream through L2 anyway), each compiled int4
model checked against eager on the same int4 model with fresh tokens.

    python3 bench/lowbit_model_prefill.py            # on the GPU
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dynamic_suite import llama  # noqa: E402
from harness import Timer  # noqa: E402
from systems import ensure_tessera_backend  # noqa: E402

import tessera as ts  # noqa: E402


def main() -> None:
    ensure_tessera_backend()
    timer = Timer(repeats=20, warmup=3, flush_l2=False)
    median_ms = lambda fn: timer(fn) / 1e3  # noqa: E731
    torch.manual_seed(0)
    torch.set_grad_enabled(False)
    model = llama(False).eval().cuda().half()
    vocab = model.config.vocab_size
    tokens = int(os.environ.get("PROMPT", "512"))
    ids = torch.randint(0, vocab, (1, tokens), device="cuda")
    res = {"eager fp16": median_ms(lambda: model(ids).logits)}
    print(f"eager fp16: {res['eager fp16']:.3f} ms", flush=True)
    quantized = ts.quantize(model, weight="int4", group_size=128, skip=("lm_head",))
    os.environ["TESSERA_LOWBIT_PREFILL"] = "dequant"  # the eager reference once, without tuning its prefill
    fresh = torch.randint(0, vocab, (1, tokens), device="cuda")
    ref = quantized(fresh).logits.float()
    modes = os.environ.get("PREFILL_MODES", "fp16,auto,dequant,register,fused").split(",")
    runs = [("tessera fp16", model, "auto")] if "fp16" in modes else []
    runs += [(f"tessera int4 {mode}", quantized, mode) for mode in modes if mode != "fp16"]
    for name, m, mode in runs:
        os.environ["TESSERA_LOWBIT_PREFILL"] = mode  # (read when the graph's kernels are planned)
        torch._dynamo.reset()
        fn = torch.compile(m, backend="tessera")
        t0 = time.time()
        fn(ids)
        torch.cuda.synchronize()
        print(f"{name}: compile {time.time() - t0:.1f} s", flush=True)
        if m is quantized:
            err = float((fn(fresh).logits.float() - ref).norm() / ref.norm())
            print(f"{name} vs eager on the int4 model (fresh tokens): rel_err {err:.2e}", flush=True)
        res[name] = median_ms(lambda fn=fn: fn(ids).logits)
        print(f"{name}: {res[name]:.3f} ms", flush=True)  # (as it goes: a run cut short keeps what it measured)
    print("\n".join(f"{name}: {ms:.3f} ms" for name, ms in res.items()))


if __name__ == "__main__":
    main()
