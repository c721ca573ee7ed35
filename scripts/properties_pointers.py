"""Check that every pointer in tests/PROPERTIES.md resolves: each file named exists, each ``file::test``
names a test of that file, each module followed by a name (`aio/wait.py` `_drains`) has that name, and
each bare test name is a test somewhere under tests/. Prints what does not resolve; exit 1 if any.

A path is taken from the repository root, else under moriio_async/, else as the one file of that
name under tests/ (the document names a property suite's files by their base name).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "tests" / "PROPERTIES.md"
TICK = re.compile(r"`([^`]+)`")
PATH = re.compile(r"^([\w./-]+\.py)(?:::([\w]+)(?:\[[^\]]*\])?)?(?::.*)?$")
# A module pointer followed by the names it points at: `aio/wait.py` `_drains`, `engine/session.py`:
# `_submit` or `_submit_one` (names up to the next module, closing parenthesis or sentence end).
MODULE_NAMES = re.compile(r"`([\w/]+\.py)`(?:'s)?:?((?:\s*(?:,|or|and|for|over|/)?\s*`[\w.]+(?:\(\))?`)+)")
NAME = re.compile(r"`([\w.]+)(?:\(\))?`")
BARE_TEST = re.compile(r"^(test_\w+)(?:\[[^\]]*\])?$")


def resolve(name: str, test: str | None = None) -> Path | None:
    """The file ``name`` points at; of several under tests/ with that base name, the one defining ``test``."""
    for base in (ROOT, ROOT / "moriio_async"):
        if (base / name).is_file():
            return base / name
    found = [p for p in sorted((ROOT / "tests").rglob(Path(name).name)) if p.as_posix().endswith("/" + name)]
    if test is not None:
        found = [p for p in found if defines_test(p, test)]
    return found[0] if len(found) == 1 else None


def defines_test(path: Path, test: str) -> bool:
    return re.search(rf"^\s*(?:async\s+)?def\s+{re.escape(test)}\b", path.read_text(), re.M) is not None


def mentions(path: Path, name: str) -> bool:
    """The module defines, calls or reads ``name`` (a planted bug may be a call removed)."""
    return re.search(rf"\b{re.escape(name.split('.')[-1])}\b", path.read_text()) is not None


def main() -> int:
    text = re.sub(r"^```.*?^```$", "", DOC.read_text(), flags=re.M | re.S)  # fenced commands point at nothing
    tests = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("*.py"))
    bad: list[str] = []
    for token in TICK.findall(text):
        m = PATH.match(token)
        if m:
            path = resolve(m.group(1), m.group(2))
            if path is None:
                what = f"no file {m.group(1)!r}" if resolve(m.group(1)) is None else f"{m.group(1)} has no"
                bad.append(f"{what} {m.group(2) or ''} (in `{token}`)")
        elif (t := BARE_TEST.match(token)) and not re.search(rf"def {t.group(1)}\b", tests):
            bad.append(f"no test {t.group(1)} under tests/")
    for module, names in MODULE_NAMES.findall(text.replace("\n", " ")):
        path = resolve(module)
        if path is None:
            continue  # reported above
        for name in NAME.findall(names):
            if not name.endswith(".py") and not mentions(path, name):
                bad.append(f"{path.relative_to(ROOT)} has no {name}")
    for line in bad:
        print(f"tests/PROPERTIES.md: {line}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
