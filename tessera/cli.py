"""Command-line interface: `tessera examples` builds and runs the example kernels."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tessera", description="tessera deep-learning compiler")
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("examples", help="build and run the example kernels, checked against numpy")
    ex.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ex.add_argument("--tolerance", type=float, default=1e-4, help="fail if a max relative error exceeds this")
    args = parser.parse_args(argv)
    if args.command == "examples":
        from tessera.examples.run import run_examples

        results = run_examples(args.device)
        bad = [r["case"] for r in results if not r["max_rel_err"] <= args.tolerance]
        if bad:
            print(f"FAILED: error above {args.tolerance} in {', '.join(bad)}", file=sys.stderr)
            return 1
        print("all examples match numpy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
