"""Worker processes return structured records, errors included: the parent never parses a child's printed text."""

from __future__ import annotations

import pytest

from kvgraft_cli.errors import CheckFailed, DeviceError, InputError, KvgraftError
from kvgraft_cli.runs.workers.local import error_from_record, error_record, run_job


def test_worker_error_comes_back_as_the_same_class_with_message_and_hint():
    seen = []
    with pytest.raises(InputError) as exc:
        run_job(
            "matrix-profile",
            {
                "profile": "portable",
                "workdir": "unused",
                "archs": ["mamba"],
                "dtypes": ["float32"],
                "samples": 1,
                "device": "cpu",
                "attn": "eager",
                "sdpa_backend": None,
                "threads": None,
            },
            seen.append,
            where="test worker",
        )
    assert type(exc.value) is InputError and exc.value.exit_code == 2
    assert exc.value.message.startswith("test worker: unknown architecture, dtype or profile: mamba")
    assert "architectures:" in exc.value.hint
    assert seen == []


def test_worker_records_arrive_as_dicts(tmp_path):
    seen = []
    records = run_job(
        "matrix-profile",
        {
            "profile": "portable",
            "workdir": str(tmp_path),
            "archs": ["llama"],
            "dtypes": ["float32"],
            "samples": 1,
            "device": "cpu",
            "attn": "eager",
            "sdpa_backend": None,
            "threads": None,
        },
        seen.append,
        where="test worker",
    )
    assert records == seen and len(records) == 1
    assert records[0]["arch"] == "llama" and records[0]["sha_equal"] == 1 and records[0]["exact"] is True


@pytest.mark.parametrize("exc", [DeviceError("no GPU", "use cpu"), CheckFailed("differs"), InputError("bad")])
def test_error_records_round_trip(exc):
    back = error_from_record(error_record(exc), "w")
    assert type(back) is type(exc) and back.exit_code == exc.exit_code
    assert back.message == f"w: {exc.message}" and back.hint == exc.hint


def test_internal_error_record_is_an_internal_error():
    back = error_from_record(error_record(ZeroDivisionError("boom")), "w")
    assert type(back) is KvgraftError and back.exit_code == 1
    assert "internal error" in back.message and "ZeroDivisionError: boom" in back.message


def test_unknown_job_is_refused():
    with pytest.raises(ValueError, match="unknown worker job"):
        run_job("nope", {}, lambda r: None, where="w")
