"""The Files API on SQLite and PostgreSQL, with the folder and the S3 artifact store."""

import io
import json

import pytest

from service.core.artifacts import open_store
from tests.conftest import Api

ROWS = [{"prompt": f"What is {i} plus {i}?", "answer": str(2 * i)} for i in range(6)]


def jsonl(rows) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


@pytest.fixture(params=["sqlite", "postgres"])
def files_api(request, settings_factory, store_settings):
    url = request.getfixturevalue("pg_url") if request.param == "postgres" else None
    return Api(settings_factory(database_url=url, GRPO_MAX_FILE_BYTES=4096, **store_settings))


def stored(api) -> int:
    return len(open_store(api.settings).list("files"))


def test_upload_list_read_delete(files_api):
    api = files_api
    body = jsonl(ROWS)
    r = api.upload(body, filename="../../etc/sums.jsonl")
    assert r.status_code == 201, r.text
    f = r.json()
    assert f["id"].startswith("file-") and f["filename"] == "sums.jsonl"
    assert (f["purpose"], f["format"], f["bytes"], f["rows"], f["columns"]) == ("train", "jsonl", len(body), 6, ["answer", "prompt"])
    import hashlib
    assert f["sha256"] == hashlib.sha256(body).hexdigest()
    corpus = api.upload(jsonl([{"id": 1, "text": "a"}, {"id": "2", "text": "b"}]), "corpus").json()
    assert api.get(f"/v1/files/{f['id']}").json() == f
    assert api.get(f"/v1/files/{f['id']}/content").content == body
    page = api.get("/v1/files?limit=1").json()
    assert [i["id"] for i in page["items"]] == [corpus["id"]] and page["has_more"]
    page2 = api.get(f"/v1/files?limit=1&after={page['next_after']}").json()
    assert [i["id"] for i in page2["items"]] == [f["id"]] and not page2["has_more"]
    assert [i["id"] for i in api.get("/v1/files?purpose=corpus").json()["items"]] == [corpus["id"]]
    # another owner sees none of it, on every route
    assert api.get("/v1/files", key=api.bob).json()["items"] == []
    for path in (f"/v1/files/{f['id']}", f"/v1/files/{f['id']}/content"):
        assert api.get(path, key=api.bob).status_code == 404
    assert api.delete(f"/v1/files/{f['id']}", key=api.bob).status_code == 404
    spec = {"kind": "grpo", "dataset": {"name": "file", "train_file": f["id"]}}
    r = api.post("/v1/jobs", json=spec, key=api.bob)
    assert r.status_code == 422 and r.json()["detail"][0]["field"] == "dataset.train_file"
    assert stored(api) == 2
    open_store(api.settings).delete(f"files/alice/{corpus['id']}")  # its bytes lost out of band: a 404, not a 500
    r = api.get(f"/v1/files/{corpus['id']}/content")
    assert r.status_code == 404 and "gone from the artifact store" in r.json()["detail"]
    assert stored(api) == 1
    assert api.delete(f"/v1/files/{f['id']}").status_code == 204
    assert api.get(f"/v1/files/{f['id']}").status_code == 404 and stored(api) == 0


def test_parquet_is_accepted(files_api):
    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist([{"query": "q1", "answers": ["a", "b"], "gold_doc_id": "d1"},
                                         {"query": "q2", "answers": ["c"], "gold_doc_id": "d2"}]), buf)
    r = files_api.upload(buf.getvalue(), "eval", filename="qa.parquet")
    assert r.status_code == 201, r.text
    assert (r.json()["format"], r.json()["rows"]) == ("parquet", 2)
    assert files_api.get(f"/v1/files/{r.json()['id']}/content").headers["content-type"] == "application/vnd.apache.parquet"


BAD = [
    ("empty", b"", "train", "the file has no rows"),
    ("blank lines only", b"\n  \n", "train", "the file has no rows"),
    ("binary", b"\x89PNG\r\n\x1a\n\x00\x00", "train", "line 1: not UTF-8"),
    ("not JSON", b'{"prompt": "a", "answer": "1"}\nhello\n', "train", "line 2: not valid JSON"),
    ("not an object", b'[1, 2]\n', "train", "line 1: a row must be a JSON object"),
    ("missing answer", jsonl([{"prompt": "p", "answer": "1"}, {"prompt": "p"}, {"answer": "x"}]), "train",
     "line 2: needs an 'answer'"),
    ("non-UTF-8 line", b'{"prompt": "a", "answer": "1"}\n{"prompt": "\xff", "answer": "1"}\n', "eval", "line 2: not UTF-8"),
    ("corpus without text", jsonl([{"id": 1}]), "corpus", "line 1: needs a non-empty string 'text'"),
    ("duplicate corpus ids", jsonl([{"id": 1, "text": "a"}, {"id": "1", "text": "b"}]), "corpus",
     "line 2: duplicate id '1' (first on line 1)"),
    ("a broken parquet", b"PAR1garbage", "train", "not a readable Parquet file"),
]


@pytest.mark.parametrize("name,content,purpose,message", BAD, ids=[b[0] for b in BAD])
def test_a_bad_file_is_a_422_naming_the_line_and_stores_nothing(sqlite_api, name, content, purpose, message):
    r = sqlite_api.upload(content, purpose)
    assert r.status_code == 422, r.text
    d = r.json()["detail"][0]
    assert d["field"] == "file" and message in d["message"], d
    assert sqlite_api.get("/v1/files").json()["items"] == [] and stored(sqlite_api) == 0


def test_bad_form_fields_and_oversize_uploads(files_api):
    api = files_api
    r = api.upload(jsonl(ROWS), purpose="pretraining")
    assert r.status_code == 422 and r.json()["detail"][0]["field"] == "purpose"
    r = api.post("/v1/files", data={"purpose": "train"})
    assert r.status_code == 422 and r.json()["detail"][0]["field"] == "file"
    big = jsonl([{"prompt": "x" * 100, "answer": "1"}] * 100)  # over GRPO_MAX_FILE_BYTES=4096 (+64 KiB framing)
    r = api.upload(big * 20)
    assert r.status_code == 413 and "larger than" in r.json()["detail"]

    def chunked():  # no Content-Length: the limit holds while streaming
        yield (b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\ntrain\r\n'
               b'--b\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n')
        for _ in range(100):
            yield b"x" * 4096

    r = api.client.post("/v1/files", headers={**api.auth(), "Content-Type": "multipart/form-data; boundary=b"},
                        content=chunked())
    assert r.status_code == 413
    assert api.get("/v1/files").json()["items"] == [] and stored(api) == 0


def test_specs_name_files_of_the_right_purpose(sqlite_api):
    api = sqlite_api
    train = api.upload(jsonl(ROWS)).json()["id"]
    val = api.upload(jsonl(ROWS[:2]), "eval").json()["id"]
    docs = api.upload(jsonl([{"id": "d", "text": "t"}]), "corpus").json()["id"]

    def submit(kind="grpo", **dataset):
        return api.post("/v1/jobs", json={"kind": kind, "dataset": {"name": "file", **dataset}})

    r = submit(train_file=val)
    assert r.status_code == 422 and "uploaded for 'eval'" in r.json()["detail"][0]["message"]
    r = submit(train_file=train, val_file=train)
    assert r.status_code == 422 and r.json()["detail"][0]["field"] == "dataset.val_file"
    r = submit(train_file="file-" + "0" * 24)
    assert r.status_code == 422 and "you have no file" in r.json()["detail"][0]["message"]
    r = submit(train_file=train, corpus_file=docs)
    assert r.status_code == 422 and "corpus_file" in r.json()["message"]
    r = submit("joint", train_file=train)
    assert r.status_code == 422 and "corpus_file is required" in r.json()["message"]
    r = submit(train_file="../x")
    assert r.status_code == 422 and r.json()["detail"][0]["field"] == "dataset.train_file"
    r = submit(train_file=train, val_file=val, num_val=5)
    assert r.status_code == 422 and "num_val" in r.json()["message"]
    assert submit("joint", train_file=train, val_file=val, corpus_file=docs).status_code == 201
    job = submit(train_file=train, val_file=val).json()
    # in use by a queued job: not deleted
    r = api.delete(f"/v1/files/{val}")
    assert r.status_code == 409 and str(job["id"]) in r.json()["detail"]
