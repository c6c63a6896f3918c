"""The artifact store on both backends: a folder, and a local S3-compatible server."""

import io

import pytest

from service.core.artifacts import ArtifactStoreError, newest_step, open_store


def test_put_list_get_delete(settings_factory, store_settings, tmp_path):
    store = open_store(settings_factory(**store_settings))
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "trainer_state.pt").write_bytes(b"state")
    (src / "adapter.bin").write_bytes(b"x" * 1000)
    (src / "sub" / "tok.json").write_text("{}")
    store.put_dir("u1/checkpoints/step-2", src)
    store.put_fileobj("u1/checkpoints/step-3/adapter.bin", io.BytesIO(b"half"))  # incomplete: no marker
    listed = store.list("u1/checkpoints")
    assert [(f.key, f.size) for f in listed] == [
        ("step-2/adapter.bin", 1000), ("step-2/sub/tok.json", 2), ("step-2/trainer_state.pt", 5),
        ("step-3/adapter.bin", 4)]
    assert newest_step(listed) == 2
    got = store.get_dir("u1/checkpoints/step-2", tmp_path / "got")
    assert (got / "sub" / "tok.json").read_text() == "{}" and (got / "adapter.bin").stat().st_size == 1000
    with store.open("u1/checkpoints/step-2/trainer_state.pt") as f:
        assert f.read() == b"state"
    assert store.list("nothing/here") == []
    with pytest.raises(FileNotFoundError):
        store.get_dir("nothing/here", tmp_path / "none")
    assert store.delete("u1") == 4
    assert store.list("u1") == [] and not store.exists("u1/checkpoints/step-2/adapter.bin")


def test_an_unreachable_store_is_a_readable_error(settings_factory, s3_server):
    from tests.conftest import free_port

    fields = s3_server.settings("gone")
    fields["GRPO_S3_ENDPOINT_URL"] = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    fields["GRPO_S3_SECRET_ACCESS_KEY"] = "s3cr3t-value"
    store = open_store(settings_factory(**fields))
    with pytest.raises(ArtifactStoreError, match=r"artifact store \(s3://gone/grpo\) could not list") as e:
        store.list("x")
    assert "s3cr3t" not in str(e.value)
