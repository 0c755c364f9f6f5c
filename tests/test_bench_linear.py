"""The linear benchmark harness on CPU: --rows-plans takes CLUSTER,WARPS_N,DEPTH[,OCCUPANCY], names
its peers so that earlier results keep their names, and the run writes JSON with ours skipped (no
GPU) and the XLA peer timed."""

import argparse
import json

import pytest

from jax_onnx_attn.bench import __main__ as bench_main
from jax_onnx_attn.bench import linear


def test_rows_plan_takes_three_or_four_fields():
    assert linear.rows_plan("4,8,2") == (4, 8, 2, 0)
    assert linear.rows_plan("0,8,4,2") == (0, 8, 4, 2)
    for bad in ("4,8", "1,2,3,4,5", "a,8,4"):
        with pytest.raises(argparse.ArgumentTypeError, match="CLUSTER,WARPS_N,DEPTH"):
            linear.rows_plan(bad)


def test_rows_plan_names_keep_the_earlier_ones():
    assert linear.rows_plan_name(linear.PLANNED_ROWS) == "ours[rows]"
    assert linear.rows_plan_name((4, 8, 2, 0)) == "ours[rows c4,w8,d2]"
    assert linear.rows_plan_name((0, 8, 4, 2)) == "ours[rows c0,w8,d4,o2]"


def test_linear_suite_with_rows_plans_writes_json(tmp_path, capsys):
    out = tmp_path / "linear.json"
    rc = bench_main.main(["linear", "--shapes", "256x128", "--rows", "8", "--formats", "int4",
                          "--impls", "ours", "xla-kn", "--block", "128", "--rows-plans", "0,8,4,2", "4,8,2",
                          "0,8,4,2", "--target-ms", "1", "--reps", "1", "--out", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["suite"] == "linear" and len(doc["results"]) == 1
    impls = doc["results"][0]["impls"]
    # The planner's rows plan first, then each forced one once.
    assert list(impls) == ["ours", "xla-kn", "ours[rows]", "ours[rows c0,w8,d4,o2]", "ours[rows c4,w8,d2]"]
    assert impls["xla-kn"]["us"] > 0
    assert all("skip" in impls[n] for n in impls if n != "xla-kn")
    assert doc["args"]["rows_plans"] == [[0, 8, 4, 2], [4, 8, 2, 0], [0, 8, 4, 2]]
    capsys.readouterr()


def test_linear_suite_with_nbits_record_writes_json(tmp_path, capsys):
    out = tmp_path / "linear.json"
    rc = bench_main.main(["linear", "--shapes", "256x128", "--rows", "1", "--formats", "int4",
                          "--impls", "ours", "xla-kn", "--nbits-record", "--target-ms", "1", "--reps", "1",
                          "--out", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    impls = doc["results"][0]["impls"]
    assert list(impls) == ["ours", "xla-kn", "ours[record]"]
    assert impls["xla-kn"]["us"] > 0 and "skip" in impls["ours[record]"]  # no GPU here
    assert doc["args"]["nbits_record"] is True
    capsys.readouterr()
