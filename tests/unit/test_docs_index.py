"""The user docs index their data: docs/training.md links every training probe kept in
docs/benchmarks/ (train_*), and the README's results table keeps to at most 8 headline rows,
each linking the docs/benchmarks/ pages it sums up; every relative link resolves."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _links(text: str) -> list[str]:
    return re.findall(r"\]\(([^)#\s]+)\)", text)


def test_training_doc_links_every_training_probe():
    text = (DOCS / "training.md").read_text()
    linked = {Path(link).stem for link in _links(text) if link.startswith("benchmarks/")}
    probes = {p.stem for p in (DOCS / "benchmarks").glob("train_*.md")}
    assert probes - linked == set(), f"probes docs/training.md does not index: {sorted(probes - linked)}"


def test_training_doc_links_resolve():
    text = (DOCS / "training.md").read_text()
    broken = [link for link in _links(text) if "://" not in link and not (DOCS / link).exists()]
    assert broken == []


def test_readme_results_table_is_at_most_eight_linked_headlines():
    section = (ROOT / "README.md").read_text().split("## Results", 1)[1].split("\n## ", 1)[0]
    rows = [ln for ln in section.splitlines() if ln.startswith("| ") and not ln.startswith("| file ")]
    assert 0 < len(rows) <= 8, f"{len(rows)} result rows: keep the README to the headlines"
    for row in rows:
        links = _links(row.split(" | ", 1)[0])
        assert links and all(link.startswith("docs/benchmarks/") for link in links), row[:80]
        assert all((ROOT / link).is_file() for link in links), row[:80]
