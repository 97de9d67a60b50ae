"""The documents point at things that exist: every relative link in README.md, CONTRIBUTING.md,
bench/RESULTS.md and docs/*.md leads to a file of the repository (and a `#anchor` into a markdown file to one
of its headings, slugged as GitHub slugs them), no link leaves the repository, and every backticked path of
the repository (`gracelm/server/app.py`, `bench/serve.py`, `docs/lifecycle.md`, or relative to `gracelm/`:
`engine/core.py:run_engine_core`) names a file or folder that exists. Reads files only: no server."""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "gracelm"
DOCUMENTS = sorted([ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "bench" / "RESULTS.md",
                    *(ROOT / "docs").glob("*.md")])
# A backticked word with one of these endings and a slash is a path, whatever its first folder.
SOURCE_SUFFIXES = {".py", ".md", ".sh", ".cpp", ".h", ".html", ".toml", ".yaml", ".yml", ".service", ".txt"}
# Words with these characters are placeholders, globs or values, not paths (`<cache>/graphs`, `$OUT/x`).
NOT_A_PATH = set("<>*$~\"'=|")

FENCE = re.compile(r"^(```|~~~).*?^\1[^\S\n]*$", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)
INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^[ ]{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.MULTILINE)
HEADING = re.compile(r"^[ ]{0,3}(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", re.MULTILINE)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


@dataclass(frozen=True)
class Document:
    path: Path
    prose: str  # the text without fenced code blocks
    code_spans: tuple[str, ...]  # the contents of its inline code spans
    text: str  # the prose with code spans blanked, where links are looked for

    @classmethod
    def read(cls, path: Path) -> Document:
        prose = FENCE.sub("", path.read_text(encoding="utf-8"))
        spans = tuple(match.group(2).strip() for match in CODE_SPAN.finditer(prose))
        return cls(path, prose, spans, CODE_SPAN.sub("code", prose))

    @property
    def name(self) -> str:
        return self.path.relative_to(ROOT).as_posix()


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its rendered text lowercased, every character but letters, marks,
    digits, connector punctuation (`_`), spaces and hyphens dropped, spaces made hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = text.replace("`", "").lower()
    kept = "".join(c for c in text if c in " -" or _word_character(c))
    return kept.replace(" ", "-")


def _word_character(c: str) -> bool:
    category = unicodedata.category(c)
    return category[0] in "LMN" or category == "Pc"


def anchors(path: Path) -> set[str]:
    """The anchors of a markdown file's headings, a repeated one suffixed `-1`, `-2`, ... as GitHub does."""
    seen: dict[str, int] = {}
    found = set()
    for match in HEADING.finditer(FENCE.sub("", path.read_text(encoding="utf-8"))):
        slug = github_slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def link_targets(document: Document) -> list[str]:
    return [m.group(1) for m in INLINE_LINK.finditer(document.text)] + [
        m.group(1) for m in REFERENCE_LINK.finditer(document.text)
    ]


def link_problem(document: Document, target: str) -> str | None:
    """Why a link of `document` is broken, or None; links to other sites are not followed."""
    if SCHEME.match(target) or target.startswith("//"):
        return None
    place, _, anchor = target.partition("#")
    resolved = (document.path.parent / place).resolve() if place else document.path
    if not resolved.is_relative_to(ROOT):
        return "leaves the repository"
    if not resolved.exists():
        return "no such file"
    if anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
        return f"no heading with the anchor #{anchor} in {resolved.relative_to(ROOT).as_posix()}"
    return None


def expand_braces(span: str) -> list[str]:
    """`engine/{detokenizer,stop_strings}.py` -> both paths."""
    match = re.search(r"\{([^{}]*)\}", span)
    if not match:
        return [span]
    head, tail = span[: match.start()], span[match.end() :]
    return [path for part in match.group(1).split(",") for path in expand_braces(head + part + tail)]


def repository_roots() -> set[str]:
    """First folders (or files) a path of the repository begins with: the repository's own entries, and those
    of `gracelm/`, which the docs may leave out (`engine/core.py`)."""
    return {p.name for p in ROOT.iterdir()} | {p.name for p in PACKAGE.iterdir()}


def repository_paths(span: str, roots: set[str]) -> list[str]:
    """The paths of the repository a code span names, alone or as words of a command: the words that look like
    one (a slash, no placeholder, and a known first folder or a source file's ending). A `:name` after a file
    is dropped."""
    words = [word for word in span.split() if not NOT_A_PATH & set(word)]
    paths = []
    for candidate in (path for word in words for path in expand_braces(word)):
        path = candidate.split(":", 1)[0]
        if "/" not in path or path.startswith(("/", ".", "-")) or not re.fullmatch(r"[\w.\-/]+", path):
            continue
        if path.split("/", 1)[0] in roots or Path(path.rstrip("/")).suffix in SOURCE_SUFFIXES:
            paths.append(path)
    return paths


def path_exists(path: str) -> bool:
    """Relative to the repository's root, or to `gracelm/`; a path ending in `/` must be a folder."""
    for base in (ROOT, PACKAGE):
        found = base / path
        if found.is_dir() if path.endswith("/") else found.exists():
            return True
    return False


@pytest.fixture(scope="module", params=DOCUMENTS, ids=lambda p: p.relative_to(ROOT).as_posix())
def document(request: pytest.FixtureRequest) -> Document:
    return Document.read(request.param)


def test_the_front_door_and_its_guide_exist() -> None:
    for name in ("README.md", "CONTRIBUTING.md", "docs/architecture.md"):
        assert (ROOT / name).is_file(), f"{name} is missing"


def test_every_relative_link_resolves(document: Document) -> None:
    broken = [
        f"{target}: {problem}"
        for target in link_targets(document)
        if (problem := link_problem(document, target)) is not None
    ]
    assert not broken, f"{document.name} has broken links:\n" + "\n".join(broken)


def test_every_backticked_repository_path_exists(document: Document) -> None:
    roots = repository_roots()
    named = {path for span in document.code_spans for path in repository_paths(span, roots)}
    missing = sorted(path for path in named if not path_exists(path))
    assert not missing, f"{document.name} names paths that do not exist:\n" + "\n".join(missing)


@pytest.mark.parametrize(
    ("heading", "slug"),
    [
        ("The offline `Engine`", "the-offline-engine"),
        ("2026-12-05 — kernel paths, graphs loaded (commit c6eaa76)",
         "2026-12-05--kernel-paths-graphs-loaded-commit-c6eaa76"),
        ("Serving against llama.cpp's llama-server", "serving-against-llamacpps-llama-server"),
        ("The Batch API and `gracelm run-batch`", "the-batch-api-and-gracelm-run-batch"),
        ("A [linked](x.md) `test_hooks` title", "a-linked-test_hooks-title"),
    ],
)
def test_headings_are_slugged_as_github_slugs_them(heading: str, slug: str) -> None:
    assert github_slug(heading) == slug


def test_paths_are_told_from_other_code_spans() -> None:
    roots = {"gracelm", "bench", "docs", "engine", "server"}
    assert repository_paths("server/app.py:build_app", roots) == ["server/app.py"]
    assert repository_paths("engine/{core,scheduler}.py", roots) == ["engine/core.py", "engine/scheduler.py"]
    assert repository_paths(".venv/bin/python bench/serve.py run --rounds 3", roots) == ["bench/serve.py"]
    assert repository_paths("gracelm serve path/to/model --api-key secret", roots) == []
    assert repository_paths("<cache>/graphs/<key>.pt2", roots) == []
    assert repository_paths("/v1/chat/completions", roots) == []
    assert repository_paths("DIR/batches.db", roots) == []
    assert repository_paths("tmp/", roots) == []
    assert repository_paths("serving/tool_parsers/", roots | {"serving"}) == ["serving/tool_parsers/"]


SECTION_REFERENCE = re.compile(r"(docs/[\w-]+\.md)(?:, \"([^\"]+)\")?")


def test_the_code_points_at_documents_and_sections_that_exist() -> None:
    """A comment naming a page (and a "Section" after it, comma-separated) names one that exists."""
    broken = []
    for file in sorted([*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.cpp"), *(ROOT / "bench").glob("*.py"),
                        *(ROOT / "tests").rglob("*.py")]):
        for page, section in SECTION_REFERENCE.findall(file.read_text(encoding="utf-8")):
            where = f"{file.relative_to(ROOT).as_posix()}: {page}"
            if not (ROOT / page).is_file():
                broken.append(f"{where}: no such page")
            elif section and github_slug(section) not in anchors(ROOT / page):
                broken.append(f"{where}: no heading {section!r}")
    assert not broken, "\n".join(broken)
