import pytest
from mlxd.daemon.settings import Settings, SettingsError, load_settings


def test_defaults_decode_from_default_toml():
    settings = load_settings()
    assert isinstance(settings, Settings)
    assert settings.server.host == "127.0.0.1"
    assert settings.server.port == 8000


def test_user_file_overrides_one_key(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[engine]\nmax_batch = 4\n")
    settings = load_settings(path)
    assert settings.engine.max_batch == 4
    assert settings.engine.prefill_chunk_tokens == load_settings().engine.prefill_chunk_tokens


def test_unknown_key_is_an_error(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[engine]\nmax_bach = 4\n")
    with pytest.raises(SettingsError, match="max_bach"):
        load_settings(path)


def test_wrong_type_is_an_error(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[server]\nport = "eighty"\n')
    with pytest.raises(SettingsError, match="port"):
        load_settings(path)


def test_cli_overrides_win(tmp_path):
    assert load_settings(overrides={"server": {"port": 9}}).server.port == 9
