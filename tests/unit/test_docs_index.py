"""The user docs index their data: docs/training.md links every training probe kept in
docs/benchmarks/ (train_*), and every relative link there resolves."""
from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"


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
