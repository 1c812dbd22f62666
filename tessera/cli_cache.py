"""`tessera cache list|size|verify|clear`: the artifact cache from the command line, on the
same module the compiler uses (tessera.backend.cache)."""

from __future__ import annotations

import argparse
import time

from tessera import settings
from tessera.backend import cache


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cache", help="list, size, verify or clear the artifact cache ($TESSERA_CACHE_DIR)",
                       description=f"The artifact cache at ${settings.CACHE_DIR.name}, else ~/.cache/tessera.")  # fmt: skip
    actions = p.add_subparsers(dest="action", required=True)
    ls = actions.add_parser("list", help="the entries: key, kind, size, age and kernel names")
    ls.add_argument("--kind", choices=["c", "cuda"], help="only entries of this kind")
    actions.add_parser("size", help="the cache's size on disk")
    verify = actions.add_parser("verify", help="check every artifact's SHA-256 and key")
    verify.add_argument("--remove", action="store_true", help="also remove the entries that fail")
    clear = actions.add_parser("clear", help="delete the cache, or what is older than --older-than days")
    clear.add_argument("--older-than", type=_days, metavar="DAYS",
                       help="only entries, tuning records and failed sources written more than DAYS days ago")


def _days(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number of days, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"a number of days >= 0, got {text!r}")
    return value


def run(args: argparse.Namespace) -> int:
    root = cache.cache_root()
    if args.action == "list":
        found = [e for e in cache.entries() if args.kind is None or e.kind == args.kind]
        now = time.time()
        for e in found:
            names = ", ".join(e.kernels[:4]) + (f", ... ({len(e.kernels)} kernels)" if len(e.kernels) > 4 else "")
            print(f"{e.key[:12]}  {e.kind:<4} {human_bytes(e.size):>9}  {_age(now - e.created):>8}  {names or '-'}")
        print(f"{len(found)} entries, {human_bytes(sum(e.size for e in found))}, "
              f"{len(cache.tuning_records())} tuning records in {root}")  # fmt: skip
    elif args.action == "size":
        found = cache.entries()
        print(f"{human_bytes(cache.total_size())} in {root} ({len(found)} entries, "
              f"{len(cache.tuning_records())} tuning records)")  # fmt: skip
    elif args.action == "verify":
        found = cache.entries()
        bad = cache.verify()
        for entry, problem in bad:
            print(f"BAD {entry.key[:12]} ({entry.path}): {problem}")
            if args.remove:
                cache.remove(entry)
        removed = " (removed)" if args.remove and bad else ""
        print(f"{len(found) - len(bad)} of {len(found)} entries intact, {len(bad)} bad{removed}")
        return 1 if bad and not args.remove else 0
    elif args.action == "clear":
        freed = cache.clear(args.older_than)
        which = "everything" if args.older_than is None else f"what is older than {args.older_than:g} days"
        print(f"cleared {which} in {root}: {human_bytes(freed)} freed")
    return 0


def human_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit}"
    return f"{max(seconds, 0):.0f} s"
