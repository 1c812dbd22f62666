"""Generated source for people: the kernels and only the prelude helpers they use.

The generated C and CUDA carry a prelude of helpers (half-float conversions, checked
division, cp.async, ldmatrix, mma, wgmma, TMA...) before the kernels; a 20-line kernel comes
after ~150 lines of them.  `readable(source)` keeps the `#include`s, the kernels and the
helpers they need (transitively: ts_copy_async needs ts_smem), in their original order, and
says how many it left out.  It is for reading: what is compiled (and cached) is the full
source, `Kernel.source_full`.

How: the source is cut into top-level items (a function, a struct, a `#define`, a macro
invocation, with the comments just before it) by following braces outside string and
character literals and comments.  An item *defines* the `ts_`/`TS_` names of its head (before
its first parenthesis or brace; a `#define`'s name; the arguments of a macro invocation) and
*uses* every `ts_`/`TS_` name in it.  Kernels (`ts_kernel_*`) are the roots.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_NAME = re.compile(r"\b(?:ts|TS)_\w+")
_KERNEL_HEAD = re.compile(r"\bts_kernel_\w+\s*\(")


@dataclass
class _Item:
    text: str
    code: str  # text without comments and literals: what names are read from
    defines: set[str] = field(default_factory=set)
    uses: set[str] = field(default_factory=set)
    kind: str = "helper"  # "include", "kernel" or "helper"


def _strip(line: str, in_comment: bool) -> tuple[str, bool]:
    """`line` without comments and string/char literal contents (braces in asm strings must not
    count), and whether a /* comment is still open at its end."""
    out = []
    i, n = 0, len(line)
    while i < n:
        if in_comment:
            end = line.find("*/", i)
            if end < 0:
                return "".join(out), True
            i, in_comment = end + 2, False
            continue
        c = line[i]
        if line.startswith("//", i):
            break
        if line.startswith("/*", i):
            in_comment, i = True, i + 2
            continue
        if c in "\"'":
            j = i + 1
            while j < n and line[j] != c:
                j += 2 if line[j] == "\\" else 1
            out.append(c + c)
            i = j + 1
            continue
        out.append(c)
        i += 1
    return "".join(out), in_comment


def _items(source: str) -> list[_Item]:
    items: list[_Item] = []
    text: list[str] = []
    code: list[str] = []
    depth, in_comment, continued = 0, False, False
    for line in source.splitlines():
        stripped, in_comment = _strip(line, in_comment)
        text.append(line)
        code.append(stripped)
        depth += stripped.count("{") + stripped.count("(") - stripped.count("}") - stripped.count(")")
        was_continued, continued = continued, stripped.rstrip().endswith("\\")
        body = stripped.strip()
        if depth > 0 or continued or in_comment:
            continue
        is_code = any(c.strip() for c in code)
        if not is_code:
            if not line.strip() and text[:-1]:  # a blank line ends a comment block that introduced nothing
                continue
            continue
        if body.endswith(("}", ";", ")")) or body.startswith("#") or was_continued:
            items.append(_item("\n".join(text), "\n".join(code)))
            text, code = [], []
    if text:
        items.append(_item("\n".join(text), "\n".join(code)))
    return items


def _item(text: str, code: str) -> _Item:
    item = _Item(text.strip("\n"), code)
    body = code.strip()
    if body.startswith("#include"):
        item.kind = "include"
        return item
    item.uses = set(_NAME.findall(code))
    define = re.match(r"#\s*define\s+(\w+)", body)
    head = re.split(r"[({=]", body, maxsplit=1)[0]
    if define:
        item.defines = {define.group(1)}
    elif _KERNEL_HEAD.search(body.split("{", 1)[0]):
        item.kind = "kernel"
    elif re.fullmatch(r"\w+\s*\(.*\)\s*;?", body, re.S):  # a macro invocation defines what it names
        item.defines = set(_NAME.findall(body.split("(", 1)[1]))
    else:
        item.defines = set(_NAME.findall(head))
    item.uses -= item.defines
    return item


def readable(source: str) -> str:
    """`source` with the includes, the kernels and only the helpers they use (see the module
    docstring); unchanged when it has no kernel or nothing to leave out."""
    items = _items(source)
    kernels = [it for it in items if it.kind == "kernel"]
    if not kernels:
        return source
    by_name: dict[str, list[_Item]] = {}
    for it in items:
        for name in it.defines:
            by_name.setdefault(name, []).append(it)
    keep: set[int] = {id(it) for it in items if it.kind != "helper"}
    stack = [name for it in kernels for name in it.uses]
    while stack:
        for it in by_name.get(stack.pop(), []):
            if id(it) not in keep:
                keep.add(id(it))
                stack.extend(it.uses)
    left_out = [it for it in items if id(it) not in keep]
    if not left_out:
        return source
    note = (f"// tessera: {len(left_out)} prelude helpers this kernel does not use are left out "
            "(Kernel.source_full has the complete source that is compiled)")  # fmt: skip
    includes = [it.text for it in items if it.kind == "include"]
    helpers = [it.text for it in items if it.kind == "helper" and id(it) in keep]
    bodies = [it.text for it in items if it.kind == "kernel"]
    return "\n\n".join(["\n".join([*includes, note, *helpers]), *bodies]) + "\n"
