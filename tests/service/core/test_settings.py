"""What the service and the workers read from the environment."""

from pathlib import Path

from service.core.settings import Settings


def test_a_variable_set_to_nothing_takes_its_default(monkeypatch, tmp_path):
    # `GRPO_MODELS_ROOT=` read as Path("") was the current folder: a run converted the bundled model into it
    monkeypatch.setenv("GRPO_DATA_DIR", str(tmp_path))
    for name in ("GRPO_MODELS_ROOT", "GRPO_ARTIFACTS_ROOT", "DATABASE_URL", "GRPO_MALLOC"):
        monkeypatch.setenv(name, "")
    s = Settings()
    assert s.models_root is None and s.models_dir == tmp_path / "models"
    assert s.artifacts_root is None and s.database_url is None
    assert s.malloc == Settings.model_fields["malloc"].default
    monkeypatch.setenv("GRPO_DATA_DIR", "")
    assert Settings().data_dir == Settings.model_fields["data_dir"].default != Path("")
