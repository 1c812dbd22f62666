import cProfile, pstats, sys, time
sys.path.insert(0, "bench")
import torch, models_suite as suite
import tessera.frontend.torch  # noqa
for name in sys.argv[1].split(","):
    model, inputs = suite.build(suite.MODELS[name])
    torch._dynamo.reset()
    with torch.no_grad():
        fn = torch.compile(model, backend="tessera")
        for _ in range(5): fn(*inputs)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(50): fn(*inputs)
        torch.cuda.synchronize()
        print(name, "per call ms", (time.perf_counter() - t0) / 50 * 1e3)
        pr = cProfile.Profile(); pr.enable()
        for _ in range(20): fn(*inputs)
        torch.cuda.synchronize()
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(14)
