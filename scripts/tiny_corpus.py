"""The training corpus of the bundled tiny models: the Python standard library and a
chosen set of permissively licensed third-party packages.

Shared by ``train_tiny.py`` and ``eval_tiny.py``. Everything is read from the
running interpreter: its stdlib (``sysconfig.get_paths()["stdlib"]``) and its
site-packages (``sysconfig.get_paths()["purelib"]``), in sorted path order.

Two validation sets are held out by file, so that no copy of them reaches training:

- ``HELDOUT_MODULES``: standard-library modules, with their tests under ``test/``;
- ``HELDOUT_PACKAGES``: whole third-party packages, in a style unlike the stdlib
  (typed, async, decorator-driven).

``leakage_filter`` also drops training files that share runs of lines with a
held-out file (vendored or forked copies).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import re
import sysconfig
from collections.abc import Iterable
from dataclasses import dataclass
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

# NOTE: the third-party validation set; each package is held out whole.
HELDOUT_PACKAGES: tuple[str, ...] = ("anyio", "click", "httpx")

# Third-party packages in training (import name -> byte cap), all under MIT, BSD,
# Apache-2.0, ISC or PSF terms (checked against the installed metadata by
# ``check_licence``). Within a cap, files are taken in the order of a hash of
# their path, so a cap samples the whole package rather than its first folders.
# Left out: GPL/MPL-licensed packages (hypothesis, tqdm, certifi, docutils), copies
# of held-out packages (httpx2 forks httpx; typer vendors click) and packages that
# are mostly data tables (idna, wcwidth).
TRAIN_PACKAGES: dict[str, int] = {
    "torch": 12_000_000,
    "transformers": 12_000_000,
    "numpy": 6_000_000,
    "sympy": 7_000_000,
    "scipy": 7_000_000,
    "networkx": 5_000_000,
    "huggingface_hub": 2_500_000,
    "pip": 1_200_000,
    "setuptools": 1_200_000,
    "IPython": 2_400_000,
    "pydantic": 1_200_000,
    "_pytest": 1_200_000,
    "trio": 1_200_000,
    "rich": 1_200_000,
    "moto": 4_000_000,
    "prompt_toolkit": 1_000_000,
    "libcst": 2_000_000,
    "mpmath": 1_900_000,
    "triton": 1_000_000,
    "fastapi": 900_000,
    "torchgen": 800_000,
    "pygments": 2_000_000,
    "jedi": 800_000,
    "fsspec": 800_000,
    "graphql": 700_000,
    "werkzeug": 700_000,
    "botocore": 600_000,
    "openai": 3_000_000,
    "filelock": 600_000,
    "jinja2": 500_000,
    "docker": 500_000,
    "pyparsing": 450_000,
    "urllib3": 450_000,
    "antlr4": 400_000,
    "cryptography": 400_000,
    "packaging": 400_000,
    "jsonschema": 350_000,
    "flask": 350_000,
    "pyasn1": 350_000,
    "traitlets": 300_000,
    "uvicorn": 300_000,
    "dateutil": 300_000,
    "parso": 300_000,
    "starlette": 300_000,
    "httpcore": 300_000,
    "boto3": 300_000,
    "s3transfer": 300_000,
    "markdown_it": 250_000,
    "yaml": 250_000,
    "requests": 250_000,
    "attr": 200_000,
    "prometheus_client": 200_000,
    "pexpect": 200_000,
    "pydantic_settings": 200_000,
    "sortedcontainers": 150_000,
    "pluggy": 150_000,
    "h11": 150_000,
    "wrapt": 150_000,
    "cloudpickle": 150_000,
    "itsdangerous": 100_000,
    "markupsafe": 100_000,
    "blinker": 100_000,
    "jmespath": 100_000,
    "referencing": 100_000,
    "executing": 100_000,
    "asttokens": 100_000,
    "stack_data": 100_000,
    "shellingham": 100_000,
    "typing_extensions": 200_000,
    "six": 100_000,
    "sniffio": 50_000,
    "outcome": 50_000,
    "decorator": 50_000,
    "xmltodict": 50_000,
    "jsonpointer": 50_000,
    "dotenv": 100_000,
    "responses": 150_000,
    # Added 2026-12-05, so that a longer run sees fewer epochs of the same stream.
    "matplotlib": 6_000_000,
    "fontTools": 3_500_000,
    "cfnlint": 2_500_000,
    "PIL": 1_000_000,
    "awscli": 1_000_000,
    "samtranslator": 1_000_000,
    "regex": 400_000,
    "cffi": 300_000,
    "jsonpath_ng": 250_000,
}

PERMISSIVE = re.compile(r"\b(MIT|BSD|Apache|ISC|PSF|Python Software Foundation|0BSD)\b")
COPYLEFT = re.compile(r"\b(GPL|LGPL|AGPL|MPL|Mozilla|Proprietary)\b", re.IGNORECASE)

# Top-level stdlib folders left out entirely: third-party code, byte-code, build
# configuration, the codec tables of encodings/ (machine-generated) and the
# prose of pydoc_data/.
EXCLUDED_TOP_LEVEL = ("site-packages", "dist-packages", "__pycache__", "encodings", "pydoc_data")
EXCLUDED_PARTS = ("__pycache__", "idle_test", "badsyntax")
MAX_FILE_BYTES = 1_000_000
# Third-party files past this size are tables or generated code.
MAX_THIRD_PARTY_FILE_BYTES = 300_000
GENERATED = re.compile(r"auto-?generated|do not edit|generated by|generated from", re.IGNORECASE)


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def site_packages_dir() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


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
    """Stdlib (train files, held-out files), stdlib-relative, sorted.

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


# ----------------------------------------------------------------- third party


@dataclass
class PackageInfo:
    """Where a third-party package came from and under which licence."""

    name: str
    distribution: str
    version: str
    licence: str


def check_licence(name: str) -> PackageInfo:
    """The package's distribution and licence; raises unless the licence is permissive."""
    distributions = importlib.metadata.packages_distributions().get(name)
    if not distributions:
        raise LookupError(f"package {name!r} is not installed; remove it from TRAIN_PACKAGES")
    dist = importlib.metadata.distribution(distributions[0])
    meta = dist.metadata
    classifiers = [
        c.split("::")[-1].strip() for c in meta.get_all("Classifier") or [] if "License" in c
    ]
    text = " ".join(
        [meta.get("License-Expression") or "", (meta.get("License") or "")[:200], *classifiers]
    )
    if COPYLEFT.search(text) or not PERMISSIVE.search(text):
        raise ValueError(
            f"package {name!r} ({dist.name} {dist.version}) is not under a permissive licence "
            f"({text.strip()!r}); remove it from TRAIN_PACKAGES"
        )
    licence = meta.get("License-Expression") or "; ".join(classifiers) or meta.get("License")
    return PackageInfo(name, dist.name, dist.version, " ".join(licence.split())[:120])


def _looks_generated_or_data(text: str) -> bool:
    lines = text.splitlines()
    if not lines or GENERATED.search(text[:1000]):
        return True
    long_lines = sum(len(line) > 200 for line in lines)
    return long_lines > 0.05 * len(lines) or max(len(line) for line in lines) > 2000


def package_documents(name: str, cap: int | None, root: Path | None = None) -> dict[str, str]:
    """{"site-packages/<path>": text} of one package's ``*.py`` files, up to ``cap`` bytes.

    Vendored copies of other packages, byte-code, generated files and data tables
    are left out; files are taken in the order of the SHA-1 of their path.
    """
    root = root or site_packages_dir()
    base = root / name
    if base.is_dir():
        candidates = list(base.rglob("*.py"))
    elif base.with_suffix(".py").is_file():
        candidates = [base.with_suffix(".py")]  # a single-module distribution (six)
    else:
        raise LookupError(f"package {name!r} is neither a folder nor a module under {root}")
    paths = [
        p
        for p in candidates
        if not any("vendor" in part or part == "__pycache__" for part in p.relative_to(root).parts)
        and 0 < p.stat().st_size <= MAX_THIRD_PARTY_FILE_BYTES
    ]
    paths.sort(key=lambda p: hashlib.sha1(p.relative_to(root).as_posix().encode()).hexdigest())
    docs: dict[str, str] = {}
    total = 0
    for path in paths:
        text = read_source(path)
        if text is None or _looks_generated_or_data(text):
            continue
        size = len(text.encode("utf-8"))
        if cap is not None and total + size > cap:
            continue
        docs["site-packages/" + path.relative_to(root).as_posix()] = text
        total += size
    return dict(sorted(docs.items()))


# -------------------------------------------------------------------- leakage

SHINGLE_LINES = 3
MIN_LINE_CHARS = 20


def _shingles(text: str) -> set[int]:
    lines = [s for s in (line.strip() for line in text.splitlines()) if len(s) >= MIN_LINE_CHARS]
    return {
        hash("\n".join(lines[i : i + SHINGLE_LINES])) for i in range(len(lines) - SHINGLE_LINES + 1)
    }


def leakage_filter(
    train: dict[str, str], heldout: Iterable[str], max_shared: int = 8, max_fraction: float = 0.1
) -> tuple[dict[str, str], dict[str, int]]:
    """Training documents without copies of held-out code, and {dropped path: shared runs}.

    A document is dropped when more than ``max_shared`` runs of three
    consecutive non-trivial lines, or more than ``max_fraction`` of its runs,
    also occur in a held-out document; exact duplicates among training
    documents are dropped too (the first path in sorted order stays).
    """
    heldout_shingles: set[int] = set()
    for text in heldout:
        heldout_shingles |= _shingles(text)
    kept: dict[str, str] = {}
    dropped: dict[str, int] = {}
    seen_content: set[str] = set()
    for path in sorted(train):
        text = train[path]
        digest = hashlib.sha1(text.encode("utf-8")).hexdigest()
        if digest in seen_content:
            dropped[path] = -1
            continue
        seen_content.add(digest)
        shingles = _shingles(text)
        shared = len(shingles & heldout_shingles)
        if shared > max_shared or (shingles and shared > max_fraction * len(shingles)):
            dropped[path] = shared
            continue
        kept[path] = text
    return kept, dropped
