"""Every benchmark saves its table through ``benchmarks.output.write_result``."""

from __future__ import annotations

import json
import re
from pathlib import Path

from benchmarks.output import write_result


def test_a_result_is_written_to_a_fresh_stamped_file_and_named(tmp_path, capsys):
    out = tmp_path / "results" / "nested"  # made if missing
    path = write_result(out, "demo-w2", {"rows": [1, 2], "out": Path("/x"), "n": 0.5})

    assert path.parent == out
    assert re.fullmatch(r"demo-w2-\d{8}-\d{6}\.json", path.name)
    assert json.loads(path.read_text()) == {"rows": [1, 2], "out": "/x", "n": 0.5}
    assert capsys.readouterr().out.strip() == f"wrote {path}"
