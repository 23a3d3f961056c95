"""The project's documents point only at things the project contains.

- every relative Markdown link (README, BENCHMARKS, REPLICATION, docs/) names an existing file, and its `#anchor`
  an existing heading;
- code and documents name project documents that exist (`docs/*.md`, `README.md`, `BENCHMARKS.md`, ...);
- nothing cites documents that were never part of the project (specification sections, notes files, issue numbers).
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {"runs", "build", "dist", "node_modules"}


def _files(suffix: str) -> list[Path]:
    found = []
    for path in ROOT.rglob(f"*{suffix}"):
        parts = path.relative_to(ROOT).parts
        if any(part.startswith(".") or part in SKIP_DIRS or part.endswith(".egg-info") for part in parts[:-1]):
            continue
        found.append(path)
    return sorted(found)


MARKDOWN = _files(".md")
PYTHON = _files(".py")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    return {_slug(m[1]) for m in re.finditer(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, re.M)}


def _links(path: Path) -> list[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    return [target for target in LINK.findall(text) if not re.match(r"[a-z]+:", target)]


def test_slug_follows_github():
    assert _slug("Fine-tuning demo: SmolLM2-135M, `lazy-only` on Brown-train (CPU)") == \
        "fine-tuning-demo-smollm2-135m-lazy-only-on-brown-train-cpu"
    assert _slug("Conversion demo (`make demo`)") == "conversion-demo-make-demo"


@pytest.mark.parametrize("document", [pytest.param(p, id=str(p.relative_to(ROOT))) for p in MARKDOWN])
def test_relative_links_resolve(document):
    broken = []
    for target in _links(document):
        file_part, _, anchor = target.partition("#")
        linked = (document.parent / file_part).resolve() if file_part else document
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{target}: no heading with anchor #{anchor}")
    assert not broken, f"{document.relative_to(ROOT)}: " + "; ".join(broken)


# Built from pieces so that this file does not match itself.
CITED_DOCUMENT = re.compile(r"\b(docs/[\w./-]+\.md|[A-Z][A-Z_]+\.md)\b")
FOREIGN = re.compile("|".join([r"\bSPEC" + r" section", r"\bSPEC" + r"\.md", "PERFORMANCE" + r"\.md",
                               "RESOURCES" + r"\.md", "HF_" + "NOTES", r"\bissue" + r"[ -]\d", r"\bper STYLE" + r"\b"]),
                     re.I)


@pytest.mark.parametrize("source", [pytest.param(p, id=str(p.relative_to(ROOT))) for p in PYTHON + MARKDOWN])
def test_cited_documents_exist_and_nothing_foreign_is_cited(source):
    text = source.read_text(encoding="utf-8")
    problems = [f"cites {m[0]!r}" for m in FOREIGN.finditer(text)]
    for name in set(CITED_DOCUMENT.findall(text)):
        if not (ROOT / name).exists() and not (source.parent / name).exists():
            problems.append(f"names {name}, which the project does not contain")
    assert not problems, f"{source.relative_to(ROOT)}: " + "; ".join(problems)
