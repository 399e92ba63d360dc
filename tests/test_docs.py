"""Docs that cannot drift: a figure in README.md, MAINTAINING.md or docs/ (validation.md aside)
that cites a row of docs/validation.md ("row 42", "rows 36, 43", "rows 25-26") must be in the
text of a row it cites. A number in the citing sentence (one sentence of a paragraph or list
item, or a table cell; a table's cells answer to the rows its caption, the paragraph right above
it, cites) that none of the cited rows contains fails, naming the file, the line, the number and
the rows.

Not figures, so not checked: the row numbers of the citation, what is in `code` (flags,
commands, names), link targets, dates, versions (0.5.23, 2.14.1), and numbers that are part of a
name (SM120, H200, P12, EAGLE-3, 8B). Numbers compare by value ("10,747" is 10747, "1.00" is
1.0), so a figure rounded differently from its row fails too."""
from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

import pytest

from sglang_image import pins

ROOT = pins.REPO_ROOT
VALIDATION = ROOT / "docs" / "validation.md"
ROW = re.compile(r"^\| (\d+) \|", re.MULTILINE)
CITATION = re.compile(r"\brows?\s+(\d+(?:-\d+)?\b(?:(?:,\s*|,?\s+and\s+)\d+(?:-\d+)?\b)*)")
NUMBER = re.compile(r"\d{1,3}(?:,\d{3})+(?!\d)(?:\.\d+)?|\d+(?:\.\d+)?")
# what is masked before numbers are read: code spans, link targets, dates, versions
NOT_FIGURES = re.compile(r"`[^`]*`|\]\([^)]*\)|\d{4}-\d{2}-\d{2}|\d+\.\d+\.\d+(?:\.?\w+)?")
SENTENCE_END = re.compile(r"(?<!e\.g)(?<!i\.e)[.!?]\)?(?=\s+[A-Z`*\[(])")


def citing_docs() -> list[Path]:
    docs = [p for p in sorted((ROOT / "docs").rglob("*.md")) if p != VALIDATION]
    return [ROOT / "README.md", ROOT / "MAINTAINING.md", *docs]


def validation_rows(text: str) -> dict[int, str]:
    """The rows of the Claims section's table: row number -> the row's whole line."""
    claims = text[text.index("\n## Claims\n"):]
    claims = claims[:claims.find("\n## ", 1)]
    return {int(m.group(1)): claims[m.start():claims.find("\n", m.start())] for m in ROW.finditer(claims)}


def value(token: str) -> Decimal:
    return Decimal(token.replace(",", "")).normalize()


def numbers(text: str) -> Iterator[tuple[int, str]]:
    """(offset, token) of each number of `text` that is not part of a name: SM120, P12, EAGLE-3,
    8B and 0-step are names (a letter or a word's hyphen before it, a letter or a hyphen and a
    letter after it); 0.97x and 86 s are figures."""
    for m in NUMBER.finditer(text):
        before, after = text[max(0, m.start() - 2):m.start()], text[m.end():m.end() + 2]
        if not (before[-1:].isalpha() or before[-1:] == "_"
                or (before[-1:] == "-" and before[:1].isalpha())
                or (after[:1].isalpha() and after[:1] != "x")
                or (after[:1] == "-" and after[1:].isalpha())):
            yield m.start(), m.group()


def figures(text: str) -> Iterator[tuple[int, str]]:
    """The numbers of a citing text that are figures: neither in code, a link target, a date, a
    version nor the citation itself."""
    masked = NOT_FIGURES.sub(lambda m: " " * len(m.group()), text)
    yield from numbers(CITATION.sub(lambda m: " " * len(m.group()), masked))


def cited_rows(text: str) -> set[int]:
    rows: set[int] = set()
    for m in CITATION.finditer(text):
        for part in re.split(r",\s*|\s+and\s+", m.group(1)):
            first, _, last = part.strip().partition("-")
            rows.update(range(int(first), int(last or first) + 1))
    return rows


@dataclass(frozen=True)
class Unit:
    """A sentence of a paragraph or list item, or a table cell, and the line it starts on. A table's
    cells also answer to the rows its caption (the paragraph right above it) cites."""
    text: str
    line: int
    caption: str = ""

    def line_of(self, offset: int) -> int:
        return self.line + self.text.count("\n", 0, offset)


def units(markdown: str) -> Iterator[Unit]:
    """The document's sentences and table cells, fenced code and headings left out."""
    block: list[str] = []  # the paragraph or list item being read
    start = 0
    caption = ""  # the paragraph before the table being read
    last_paragraph = ""
    fenced = False

    def sentences() -> Iterator[Unit]:
        text = "\n".join(block)
        at = 0
        for m in SENTENCE_END.finditer(text):
            yield Unit(text[at:m.end()], start + text.count("\n", 0, at))
            at = m.end()
        yield Unit(text[at:], start + text.count("\n", 0, at))

    for number, line in enumerate(markdown.splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
        ends_block = (fenced or line.startswith(("```", "|", "#")) or not line.strip()
                      or re.match(r"\s*(?:[-*]|\d+\.) ", line) is not None)
        if ends_block and block:
            yield from sentences()
            last_paragraph, block = "\n".join(block), []
        if line.startswith("|") and not fenced:
            caption = caption or last_paragraph
            for cell in line.strip("|").split("|"):
                yield Unit(cell, number, caption)
            continue
        caption = ""
        if fenced or line.startswith(("```", "#")):
            last_paragraph = ""
            continue
        if not line.strip():
            continue
        if not block:
            start = number
        block.append(line)
    if block:
        yield from sentences()


def drifted(path: Path, rows: dict[int, str], root: Path = ROOT) -> list[str]:
    """One line per figure of `path` that none of the rows it cites contains."""
    found: list[str] = []
    name = path.relative_to(root)
    for unit in units(path.read_text()):
        cited = {n for n in cited_rows(unit.text) | cited_rows(unit.caption) if n in rows}
        if not cited:
            continue
        known = {value(t) for n in cited for _, t in numbers(rows[n])}
        for offset, token in figures(unit.text):
            if value(token) not in known:
                found.append(f"{name}:{unit.line_of(offset)}: {token} is in none of the cited "
                             f"rows ({', '.join(map(str, sorted(cited)))})")
    return found


def test_every_cited_figure_is_in_its_row() -> None:
    rows = validation_rows(VALIDATION.read_text())
    assert sorted(rows) == list(range(1, len(rows) + 1)) and len(rows) >= 40, sorted(rows)
    problems = [p for path in citing_docs() for p in drifted(path, rows)]
    assert not problems, "figures that their validation rows do not contain:\n" + "\n".join(problems)


def test_a_figure_changed_without_its_row_fails(tmp_path: Path) -> None:
    rows = {36: "| 36 | **threshold 16 at 0.97x plain at 64 requests (interval 0.94-0.97)** | 10,772 |",
            43: "| 43 | 0.967x plain [0.95-0.98] over 6 blocks | 0.07 ms |"}
    doc = tmp_path / "README.md"
    doc.write_text("The threshold server held 0.97x [0.94-0.97] at 64 requests (row 36).\n"
                   "At 64 it ran 10,772 tok/s, 0.967x plain on `sglang-0.5.23` ([rows 36,\n"
                   "43](docs/validation.md)), measured 2026-12-04 on an H200.\n")
    assert drifted(doc, rows, tmp_path) == []
    doc.write_text(doc.read_text().replace("0.97x [0.94", "0.98x [0.94").replace("10,772", "10,773"))
    assert drifted(doc, rows, tmp_path) == [
        "README.md:1: 0.98 is in none of the cited rows (36)",
        "README.md:2: 10,773 is in none of the cited rows (36, 43)"]


def test_a_table_answers_to_the_rows_its_caption_cites(tmp_path: Path) -> None:
    rows = {27: "| 27 | threshold 16: c=64 10,747 / 10,009 / 10,233, 0.95x [0.94-0.97] |"}
    table = "| C | plain | threshold 16 |\n|---:|---:|---:|\n| 64 | 10,747 | 10,233 (0.95x [0.94-0.97]) |\n"
    doc = tmp_path / "README.md"
    doc.write_text(f"Paired windows ([row 27](docs/validation.md)).\n\n{table}")
    assert drifted(doc, rows, tmp_path) == []
    doc.write_text(f"Paired windows ([row 27](docs/validation.md)).\n\n{table.replace('10,233', '10,323')}")
    assert drifted(doc, rows, tmp_path) == ["README.md:5: 10,323 is in none of the cited rows (27)"]
    # a table under a paragraph that cites nothing is not checked, nor one after a heading
    doc.write_text(f"Paired windows.\n\n{table.replace('10,233', '10,323')}\n## Next\n\n{table}")
    assert drifted(doc, rows, tmp_path) == []


@pytest.mark.parametrize("text, rows", [
    ("rows 25-26 and 31", {25, 26, 31}), ("rows 38, 40,\n42", {38, 40, 42}),
    ("(validation.md, rows 12 and 17)", {12, 17}), ("row 7 of the", {7}), ("rows are zeros", set())])
def test_citations_are_read_with_their_ranges_and_lists(text: str, rows: set[int]) -> None:
    assert cited_rows(text) == rows


def test_names_dates_versions_and_code_are_not_figures() -> None:
    text = ("On `sglang-0.5.23` (torch 2.14.1, 2026-12-04) an H200 ran EAGLE-3 on the 8B shape with P12:"
            " 0.96-0.99x, 1,766 steps, ±10-25% (`--bench-concurrency 64,256`) [row 4](a/b-7.md)")
    assert [t for _, t in figures(text)] == ["0.96", "0.99", "1,766", "10", "25"]
