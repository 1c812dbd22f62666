"""Run the graph fuzzer outside CI: N random graphs (default 10,000), compiled on the CPU and
checked against the reference; prints the counts and writes minimized reproducers.

    python3 tests/fuzz/run.py [-n 10000] [--seed 0] [--batch 40] [--jobs 2] [--out fuzz-failures]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the fuzz package
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for tessera

from fuzz.driver import cpu_count, generate, now, report, run_many, write_reproducers  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", type=int, default=10_000, help="number of graphs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=40, help="graphs packed into one compiled graph")
    p.add_argument("--jobs", type=int, default=min(2, cpu_count()), help="batches checked at a time")
    p.add_argument("--max-ops", type=int, default=10)
    p.add_argument("--out", type=Path, default=Path("fuzz-failures"), help="where reproducers go")
    p.add_argument("--no-minimize", action="store_true")
    args = p.parse_args(argv)
    start = now()
    specs = generate(args.n, args.seed, args.max_ops)
    print(f"generated {len(specs)} graphs in {now() - start:.0f} s", flush=True)
    done = [0]

    def progress(r):
        if r.graphs // 1000 > done[0]:
            done[0] = r.graphs // 1000
            print(f"  {r.graphs} graphs, {len(r.failures)} failures, {now() - start:.0f} s", flush=True)

    result = run_many(specs, args.batch, args.jobs, progress=progress)
    print(report(result, now() - start))
    if result.failures:
        paths = write_reproducers(result.failures, args.out, do_minimize=not args.no_minimize)
        print(f"reproducers: {', '.join(str(p) for p in paths)}")
    return 1 if result.failures else 0


if __name__ == "__main__":
    sys.exit(main())
