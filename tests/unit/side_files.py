"""Shared check for the kit's JSON side files (SPS tables, STS calibrations): a file that cannot
be used is refused with one line naming the file and the reason."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest


def assert_refused_in_one_line(load: Callable[[Path], object], path: Path, error: type[Exception],
                               needle: str) -> str:
    """``load(path)`` raises ``error`` whose message is one line holding ``path`` and ``needle``."""
    with pytest.raises(error) as err:
        load(path)
    msg = str(err.value)
    assert str(path) in msg and needle in msg and "\n" not in msg, msg
    return msg
