"""The training corpus of the bundled tiny models: the Python standard library.

Shared by ``train_tiny.py`` and ``eval_tiny.py``. The corpus is the ``*.py`` source
that ships with the running interpreter (``sysconfig.get_paths()["stdlib"]``), in
sorted path order. A fixed list of modules (``HELDOUT_MODULES``) is held out for
validation, together with their test files under ``test/``, so that no copy of
the held-out source leaks into training.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

# NOTE: changing this list changes the validation set of the bundled models; the
# figures in ssmserve/model_data/README.md are for exactly these modules.
HELDOUT_MODULES: tuple[str, ...] = (
    "base64",
    "bisect",
    "calendar",
    "colorsys",
    "csv",
    "difflib",
    "fnmatch",
    "fractions",
    "glob",
    "graphlib",
    "heapq",
    "json",
    "netrc",
    "queue",
    "sched",
    "shlex",
    "statistics",
    "string",
    "textwrap",
    "tomllib",
    "wave",
)

# Top-level folders left out entirely: third-party code, byte-code, build
# configuration, the codec tables of encodings/ (machine-generated) and the
# prose of pydoc_data/.
EXCLUDED_TOP_LEVEL = ("site-packages", "dist-packages", "__pycache__", "encodings", "pydoc_data")
EXCLUDED_PARTS = ("__pycache__", "idle_test", "badsyntax")
MAX_FILE_BYTES = 1_000_000


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _heldout_test_names() -> set[str]:
    return {f"test_{name}" for name in HELDOUT_MODULES}


def module_of(rel: Path) -> str:
    """Top-level module name a stdlib-relative path belongs to (``json/decoder.py`` -> json)."""
    return rel.parts[0].removesuffix(".py")


def _is_heldout_test(rel: Path) -> bool:
    # test/test_json/..., test/test_csv.py, lib2to3 has no such names.
    names = _heldout_test_names()
    return any(part.removesuffix(".py") in names for part in rel.parts)


def list_source_files(root: Path | None = None) -> tuple[list[Path], list[Path]]:
    """(train files, held-out files), stdlib-relative, sorted.

    Held-out files are the sources of HELDOUT_MODULES outside their ``test*``
    subfolders; their tests are dropped from both sets.
    """
    root = root or stdlib_dir()
    train: list[Path] = []
    heldout: list[Path] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in EXCLUDED_TOP_LEVEL or rel.parts[0].startswith("config-"):
            continue
        if any(part in EXCLUDED_PARTS for part in rel.parts):
            continue
        if rel.name.startswith("_sysconfigdata"):
            continue
        if path.stat().st_size > MAX_FILE_BYTES or path.stat().st_size == 0:
            continue
        if _is_heldout_test(rel):
            continue
        if module_of(rel) in HELDOUT_MODULES and len(rel.parts) == 1:
            heldout.append(rel)
        elif module_of(rel) in HELDOUT_MODULES:
            # Packages (json/, tomllib/): their sources, not their bundled tests.
            if not any(part.startswith("test") for part in rel.parts[1:]):
                heldout.append(rel)
        else:
            train.append(rel)
    return train, heldout


def read_source(path: Path) -> str | None:
    """The file's text, or None where it is not UTF-8 (a few test fixtures)."""
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def read_documents(files: list[Path], root: Path | None = None) -> dict[str, str]:
    """{stdlib-relative path: text} for the files that decode as UTF-8."""
    root = root or stdlib_dir()
    docs: dict[str, str] = {}
    for rel in files:
        text = read_source(root / rel)
        if text is not None:
            docs[rel.as_posix()] = text
    return docs
