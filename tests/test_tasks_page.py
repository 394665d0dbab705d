"""docs/tasks.md runs as shown: its python blocks, in order, against a fresh database."""

from __future__ import annotations

import contextlib
import io
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine
from sqlalchemy.engine import URL

PAGE = Path(__file__).resolve().parent.parent / "docs" / "tasks.md"


def test_the_tasks_page_runs(create_database: Callable[[], URL]) -> None:
    blocks = re.findall(r"^```python\n(.*?)^```", PAGE.read_text(encoding="utf-8"), re.S | re.M)
    assert len(blocks) == 11
    engine = create_engine(create_database())
    namespace: dict[str, Any] = {"engine": engine, "__name__": "tasks_page"}
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            for number, block in enumerate(blocks, 1):
                exec(compile(block, f"docs/tasks.md, block {number}", "exec", dont_inherit=True), namespace)
    finally:
        engine.dispose()
    refused = [line.split(" - ", 1)[0] for line in printed.getvalue().splitlines() if " - " in line]
    assert refused == ["invoice_id", "cc", "copy_to"], printed.getvalue()
    assert "attempt 1: invoice 1 to ada@example.com" in printed.getvalue()
    assert "failed: dead job " in printed.getvalue() and "the warehouse is down" in printed.getvalue()
    assert re.search(r"^total \d+ returned 6$", printed.getvalue(), re.M), printed.getvalue()  # the middleware
    assert re.search(r"^total \d+ took \d+\.\d{3} s$", printed.getvalue(), re.M)
    assert namespace["new_style"].parameters.form == "arguments"
    assert "exported 1000 rows; last report: Progress(fraction=1.0, message='1000 of 1000 rows')" in printed.getvalue()
    assert namespace["old_style"].parameters.form == "job"
