"""Uploads within budgets: files built to exhaust the API are refused with a 413 naming the limit,
before what lies past the limit is decoded, and store nothing; uploads beyond the concurrency limits
get 429. The files are issue 25's, scaled where a test machine need not spend a gigabyte to build one."""

import io
import threading

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from service.core.datafiles import Budget, OverBudget, check_file_isolated
from tests.conftest import Api

ROW = {"prompt": "What is 2 + 3?", "answer": "5"}


def _parquet(table: pa.Table, **kw) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf, **kw)
    return buf.getvalue()


def compressed_column(mib: int) -> bytes:
    """One row group whose prompt column is `mib` MiB of repeated text, zstd-compressed to a few KB."""
    rows = mib * 16
    return _parquet(pa.table({"prompt": pa.array(["x" * 65536] * rows), "answer": ["5"] * rows}),
                    compression="zstd", use_dictionary=False)


def many_rows(n: int) -> bytes:
    """`n` rows that all point at one dictionary entry: about 0.1 byte a row on disk."""
    col = pa.DictionaryArray.from_arrays(pa.array([0] * n, pa.int8()), pa.array([ROW["prompt"]]))
    return _parquet(pa.table({"prompt": col, "answer": pa.DictionaryArray.from_arrays(
        pa.array([0] * n, pa.int8()), pa.array(["5"]))}), compression="zstd", row_group_size=1 << 24)


def dictionary_bomb(rows: int, value_bytes: int) -> bytes:
    """Small pages that decode far past their size: every row is the same long dictionary entry."""
    col = pa.DictionaryArray.from_arrays(pa.array([0] * rows, pa.int8()), pa.array(["y" * value_bytes]))
    return _parquet(pa.table({"prompt": col, "answer": ["5"] * rows}), compression="zstd")


CASES = [  # (case, file, settings, the limit named)
    ("a 41 KB-style column that decompresses to 160 MiB", lambda: compressed_column(160), {},
     "GRPO_MAX_ROW_GROUP_BYTES"),
    ("20 million rows in a small file", lambda: many_rows(20_000_000), {}, "GRPO_MAX_FILE_ROWS"),
    ("a JSONL line of 100 MB", lambda: b'{"prompt": "' + b"z" * 100_000_000 + b'", "answer": "1"}\n', {},
     "GRPO_MAX_ROW_BYTES"),
    ("more JSONL lines than allowed", lambda: (b'{"prompt": "q", "answer": "1"}\n' * 1001), {"max_file_rows": 1000},
     "GRPO_MAX_FILE_ROWS"),
    ("dictionary pages that decode past the budget", lambda: dictionary_bomb(200_000, 1000),
     {"max_decoded_bytes": 32 << 20}, "GRPO_MAX_DECODED_BYTES"),
    ("a Parquet row past the row limit", lambda: _parquet(pa.table({"prompt": ["w" * 2_000_000], "answer": ["1"]})),
     {}, "GRPO_MAX_ROW_BYTES"),
]


@pytest.fixture(params=["sqlite", "postgres"])
def budget_api(request, settings_factory):
    url = request.getfixturevalue("pg_url") if request.param == "postgres" else None

    def make(**settings):
        return Api(settings_factory(database_url=url, **{f"GRPO_{k.upper()}": v for k, v in settings.items()}))

    return make


@pytest.mark.parametrize("case,build,settings,limit", CASES, ids=[c[0] for c in CASES])
def test_a_file_past_a_budget_is_a_413_naming_the_limit_and_stores_nothing(budget_api, case, build, settings, limit):
    api = budget_api(**settings)
    r = api.upload(build(), filename="bomb.parquet")
    assert r.status_code == 413, r.text[:500]
    assert limit in r.json()["detail"] and "bomb.parquet" in r.json()["detail"]
    assert api.get("/v1/files").json()["items"] == []
    assert api.upload(b'{"prompt": "q", "answer": "1"}\n').status_code == 201  # and the API goes on


def test_a_check_past_its_memory_is_ended_not_the_api(tmp_path):
    path = tmp_path / "big.parquet"
    path.write_bytes(compressed_column(400))  # 400 MiB in one row group, allowed by the budget given
    with pytest.raises(OverBudget) as exc:
        check_file_isolated(path, "train", budget=Budget(max_row_group_bytes=1 << 30, max_decoded_bytes=1 << 30),
                            memory_bytes=256 << 20, timeout_s=60)
    assert exc.value.limit == "GRPO_UPLOAD_MEMORY_BYTES"


def test_a_check_past_its_time_is_ended(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"prompt": "q", "answer": "1"}\n' * 200_000)
    with pytest.raises(OverBudget, match="longer than 0.05 s") as exc:
        check_file_isolated(path, "train", budget=Budget(), memory_bytes=1 << 30, timeout_s=0.05)
    assert exc.value.limit == "GRPO_UPLOAD_CHECK_S"


def test_uploads_past_the_concurrency_limits_get_429(sqlite_api):
    slots = sqlite_api.client.app.state.upload_slots
    with slots.take("alice"), slots.take("alice"):  # alice's two checks are running
        r = sqlite_api.upload(b'{"prompt": "q", "answer": "1"}\n')
        assert r.status_code == 429 and "GRPO_MAX_UPLOADS_PER_OWNER" in r.json()["detail"]
        assert r.headers["retry-after"] == "2"
        assert sqlite_api.upload(b'{"prompt": "q", "answer": "1"}\n', key=sqlite_api.bob).status_code == 201
    with slots.receiving(), slots.receiving(), slots.receiving(), slots.receiving():  # four bodies: the limit
        r = sqlite_api.upload(b'{"prompt": "q", "answer": "1"}\n', key=sqlite_api.bob)  # refused before it is read
        assert r.status_code == 429 and "GRPO_MAX_UPLOADS)" in r.json()["detail"]
        assert r.headers["retry-after"] == "2"
    assert sqlite_api.upload(b'{"prompt": "q", "answer": "1"}\n').status_code == 201
    assert slots.owners.total() == 0 and slots.bodies == 0


def test_slots_are_given_back_when_a_check_fails(sqlite_api):
    for _ in range(3):
        assert sqlite_api.upload(b'{"prompt": "q", "answer": "1"}\n' * 1 + b"not json\n").status_code == 422
        assert sqlite_api.upload(b'{"prompt": "' + b"z" * 2_000_000 + b'"}\n').status_code == 413
    assert sqlite_api.client.app.state.upload_slots.owners.total() == 0
    assert threading.active_count() < 50
