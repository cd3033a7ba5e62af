"""benchmarks/run.py: runs the chosen benchmarks (``--jobs`` at a time), reports them in its
order and writes the suite's JSON; bad arguments stop it with a message naming them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import run


def test_two_jobs_report_in_order(tmp_path, monkeypatch, capsys):
    started = []

    def fake_run_one(script, out, gpu, timeout, check):
        started.append(script.stem)
        (out / f"{script.stem}.json").write_text(json.dumps({"ratio": 1.0}))
        return {"benchmark": script.stem, "rc": 0, "status": "ok", "seconds": 0.0,
                "json": str(out / f"{script.stem}.json"), "ratios": {"ratio": 1.0}}  # fmt: skip

    monkeypatch.setattr(run, "run_one", fake_run_one)
    assert run.main(["--out", str(tmp_path), "--jobs", "2", "--only", "gemm,structure,norm"]) == 0
    printed = [ln.split()[0] for ln in capsys.readouterr().out.splitlines()[:3]]
    assert printed == ["structure", "gemm", "norm"]  # ORDER, whatever finished first
    assert sorted(started) == ["gemm", "norm", "structure"]
    suite = json.loads((tmp_path / "suite.json").read_text())
    assert suite["jobs"] == 2
    assert [r["benchmark"] for r in suite["benchmarks"]] == printed


@pytest.mark.parametrize(
    ("argv", "match"), [(["--jobs", "0"], "--jobs"), (["--only", "nope"], "--only")]
)
def test_bad_arguments(tmp_path, capsys, argv, match):
    with pytest.raises(SystemExit):
        run.main(["--out", str(tmp_path), *argv])
    assert match in capsys.readouterr().err
