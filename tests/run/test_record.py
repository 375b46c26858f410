"""run.record: the typed job record and its JSON file."""

from __future__ import annotations

import json

from transformers_lab.run.record import (
    RESULT_FILE,
    JobRecord,
    Monitor,
    Outcome,
    read_record,
    write_record,
)


def test_a_record_round_trips_through_its_file(tmp_path):
    record = JobRecord(
        overrides=["seed=1"], run_dir=str(tmp_path), monitor=Monitor("val/acc", "max")
    )
    outcome = Outcome({"val/acc": 0.75, "val/loss": 0.5}, 0.8, 1234, {"best": "b", "last": "l"}, 64)
    record.finished(outcome)
    record.time_s = 1.5
    write_record(tmp_path, record)
    back = read_record(tmp_path)
    assert back == record
    assert (back.status, back.objective, back.monitor.best) == ("ok", 0.75, 0.8)
    assert (back.params, back.state_size, back.checkpoints["last"]) == (1234, 64, "l")
    saved = json.loads((tmp_path / RESULT_FILE).read_text())
    assert saved["monitor"] == {"metric": "val/acc", "mode": "max", "best": 0.8}


def test_best_of_answers_only_for_the_monitored_metric():
    record = JobRecord(monitor=Monitor("val/loss", "min", 1.5))
    assert record.best_of("val/loss") == 1.5 and record.best_of("val/acc") is None


def test_older_and_broken_records_still_read(tmp_path):
    (tmp_path / RESULT_FILE).write_text(
        json.dumps(
            {
                "status": "failed",
                "overrides": ["x=1"],
                "error": "E",
                "metrics": None,
                "an_old_key": 1,
                "monitor": {"metric": "val/loss"},
            }
        )  # fmt: skip
    )
    record = read_record(tmp_path)
    assert (record.status, record.error, record.metrics) == ("failed", "E", {})
    assert record.monitor == Monitor("val/loss", "min", None)
    (tmp_path / RESULT_FILE).write_text("{not json")
    assert read_record(tmp_path) is None
    assert read_record(tmp_path / "nowhere") is None
