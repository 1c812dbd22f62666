"""tessera.settings: every TESSERA_* variable declared once, read at call time, validated in one place."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from tessera import settings
from tessera.errors import ArgumentError, CompilerNotFoundError

ROOT = Path(__file__).resolve().parents[1] / "tessera"

# accessor, its variable, the value when unset, a valid value and what it reads as, an invalid value
CASES = [
    (settings.tune, "TESSERA_TUNE", True, "off", False, "sometimes"),
    (settings.progress, "TESSERA_PROGRESS", None, "ON", True, "maybe"),
    (settings.pdl, "TESSERA_PDL", True, "0", False, "2"),
    (settings.lowbit_prefill, "TESSERA_LOWBIT_PREFILL", "auto", "Register", "register", "always"),
    (settings.implicit_conv, "TESSERA_IMPLICIT_CONV", True, "no", False, "im2col"),
    (settings.cpu_isa_cap, "TESSERA_CPU_ISA", None, "avx2", "avx2", "sse9"),
    (settings.api_key, "TESSERA_API_KEY", None, " sk-Abc_123 ", "sk-Abc_123", "two words"),
]


def test_every_variable_is_declared_once():
    declared = [s for s in vars(settings).values() if isinstance(s, settings.Setting)]
    names = [s.name for s in declared]
    assert len(names) == len(set(names)) == len(settings.DECLARED) == 10
    assert set(names) == set(settings.DECLARED)
    for s in declared:
        assert s.name.startswith("TESSERA_") and s.doc and s.kind in ("bool", "choice", "path", "executable", "token")
        assert (s.kind == "choice") == bool(s.choices)
        assert s.default is None or s.kind != "choice" or s.default in s.choices


def test_the_accessors_cover_every_variable():
    covered = {case[1] for case in CASES} | {"TESSERA_CACHE_DIR", "TESSERA_CC", "TESSERA_NVCC"}
    assert covered == set(settings.DECLARED)


@pytest.mark.parametrize(("accessor", "name", "default", "valid", "parsed", "invalid"), CASES, ids=[c[1] for c in CASES])
def test_accessor(monkeypatch, accessor, name, default, valid, parsed, invalid):
    monkeypatch.delenv(name, raising=False)
    assert accessor() == default
    monkeypatch.setenv(name, "  ")  # empty counts as unset
    assert accessor() == default
    monkeypatch.setenv(name, valid)  # read at call time, after import
    assert accessor() == parsed
    monkeypatch.setenv(name, invalid)
    with pytest.raises(ArgumentError, match=rf"\${name}='{invalid}': use ") as info:
        accessor()
    setting = settings.DECLARED[name]
    for allowed in setting.choices or (("1/on", "0/off") if setting.kind == "bool" else (setting.allowed(),)):
        assert allowed in str(info.value)


def test_cache_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("TESSERA_CACHE_DIR", raising=False)
    assert settings.cache_dir() == Path.home() / ".cache" / "tessera"
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path / "c"))
    assert settings.cache_dir() == tmp_path / "c"
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("TESSERA_CACHE_DIR", "~/elsewhere")
    assert settings.cache_dir() == tmp_path / "elsewhere"


@pytest.mark.parametrize("name", ["TESSERA_CC", "TESSERA_NVCC"])
def test_compiler(monkeypatch, tmp_path, name):
    monkeypatch.delenv(name, raising=False)
    assert settings.compiler(name) is None
    monkeypatch.setenv(name, "sh")  # a command name is looked up on PATH
    assert settings.compiler(name) == shutil.which("sh")
    monkeypatch.setenv(name, str(tmp_path / "no-such-compiler"))
    with pytest.raises(CompilerNotFoundError, match=rf"\${name} is set to .*no-such-compiler.*not an executable"):
        settings.compiler(name)
    with pytest.raises(ArgumentError, match="TESSERA_CC or TESSERA_NVCC"):
        settings.compiler("TESSERA_TUNE")


def test_an_undeclared_name_is_refused():
    with pytest.raises(ArgumentError, match="TESSERA_NOPE is not a tessera setting"):
        settings.value("TESSERA_NOPE")


READS = re.compile(r"""(environ\b|getenv\()[^\n]*TESSERA_|["']TESSERA_\w+["']""")


def test_only_settings_reads_tessera_variables():
    """No module but tessera/settings.py reads a TESSERA_ variable from the environment, or even
    spells one as a string (that is how a second reader would start)."""
    offenders = [f"{path.relative_to(ROOT.parent)}:{n}: {line.strip()}"
                 for path in sorted(ROOT.rglob("*.py")) if path.name != "settings.py" or path.parent != ROOT
                 for n, line in enumerate(path.read_text().splitlines(), 1) if READS.search(line)]  # fmt: skip
    assert offenders == []
