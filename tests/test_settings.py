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


# ---- MLXD_<SECTION>__<KEY> environment variables ------------------------------------------


@pytest.mark.parametrize(
    ("name", "text", "section", "key", "value"),
    [
        ("MLXD_SERVER__PORT", "9000", "server", "port", 9000),
        ("MLXD_SERVER__HOST", "0.0.0.0", "server", "host", "0.0.0.0"),
        ("MLXD_ENGINE__MAX_BATCH", "8", "engine", "max_batch", 8),
        ("MLXD_MEMORY__DEVICE_FRACTION", "0.5", "memory", "device_fraction", 0.5),
        ("MLXD_PREFIX_CACHE__ENABLED", "false", "prefix_cache", "enabled", False),
        ("MLXD_SPECULATIVE__DRAFTER", "lookup", "speculative", "drafter", "lookup"),
        ("MLXD_AUTH__API_KEYS", "k1, k2", "auth", "api_keys", ["k1", "k2"]),
        ("MLXD_SERVER__CORS_ORIGINS", '["https://a.example"]', "server", "cors_origins",
         ["https://a.example"]),
        ("MLXD_MODEL__PATH", "acme/tiny", "model", "path", "acme/tiny"),
        ("MLXD_LOGGING__LEVEL", "debug", "logging", "level", "DEBUG"),
    ],
)  # fmt: skip
def test_an_environment_variable_sets_its_setting_with_the_fields_type(
    name, text, section, key, value
):
    settings = load_settings(environ={name: text})
    assert getattr(getattr(settings, section), key) == value
    assert getattr(getattr(load_settings(environ={}), section), key) != value


def test_precedence_defaults_file_environment_flags(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[server]\nport = 1001\n[engine]\nmax_batch = 3\n")
    env = {"MLXD_SERVER__PORT": "1002", "MLXD_ADMISSION__MAX_WAITING": "5"}
    flags = {"server": {"port": 1003}}
    assert load_settings().server.port == 8000
    assert load_settings(path).server.port == 1001
    both = load_settings(path, environ=env)
    assert (both.server.port, both.engine.max_batch, both.admission.max_waiting) == (1002, 3, 5)
    assert load_settings(path, flags, env).server.port == 1003
    assert load_settings(None, flags, env).admission.max_waiting == 5


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"MLXD_SERVER__PORT": "eighty"}, "MLXD_SERVER__PORT='eighty': Expected `int`"),
        ({"MLXD_SERVER__PORT": "70000"}, "MLXD_SERVER__PORT='70000': Expected `int` <= 65535"),
        ({"MLXD_ENGINE__MAX_BATCH": "0"}, "MLXD_ENGINE__MAX_BATCH='0': Expected `int` >= 1"),
        ({"MLXD_PREFIX_CACHE__ENABLED": "maybe"}, "MLXD_PREFIX_CACHE__ENABLED='maybe'"),
        ({"MLXD_MODEL__KIND": "audio"}, "MLXD_MODEL__KIND='audio'"),
        ({"MLXD_SERVER__PROT": "1"}, "MLXD_SERVER__PROT: no such setting"),
        ({"MLXD_SERVRE__PORT": "1"}, "MLXD_SERVRE__PORT: no such setting"),
        ({"MLXD_SERVER_PORT": "1"}, "MLXD_SERVER_PORT: no such setting"),
        ({"MLXD_MODELS__PATH": "x"}, "MLXD_MODELS__PATH: no such setting"),
        ({"MLXD_MODELS": "[]"}, "MLXD_MODELS: no such setting"),
        ({"MLXD_SERVER": "x"}, "MLXD_SERVER: no such setting"),
    ],
)
def test_a_bad_environment_variable_is_an_error_naming_it(env, message):
    with pytest.raises(SettingsError) as caught:
        load_settings(environ=env)
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_validation_error_after_the_environment_says_so():
    with pytest.raises(SettingsError, match=r"environment \+ flags\): .*logging.level"):
        load_settings(environ={"MLXD_LOGGING__LEVEL": "loud"})


def test_other_mlxd_variables_are_not_settings():
    assert load_settings(environ={"MLXD_BLAS_CHECKED": "1", "MLXDX": "1"}) == load_settings()


def test_without_environ_the_environment_is_not_read(monkeypatch):
    monkeypatch.setenv("MLXD_SERVER__PORT", "9000")
    assert load_settings().server.port == 8000  # only the CLI passes os.environ


# ---- model.chat_template --------------------------------------------------------------------


def test_chat_template_is_a_jinja_string_or_a_file(tmp_path):
    template = "{% for m in messages %}[{{ m.content }}]{% endfor %}"
    inline = load_settings(overrides={"model": {"chat_template": template}})
    assert inline.model.chat_template_text() == template
    path = tmp_path / "t.jinja"
    path.write_text(template)
    from_file = load_settings(overrides={"model": {"chat_template": str(path)}})
    assert from_file.model.chat_template_text() == template
    assert load_settings().model.chat_template_text() == ""
    missing = load_settings(overrides={"model": {"chat_template": str(tmp_path / "none.jinja")}})
    with pytest.raises(ValueError, match="model.chat_template: cannot read .*none.jinja"):
        missing.model.chat_template_text()


# ---- LoRA adapters per request --------------------------------------------------------------


def test_adapter_flags_fill_the_one_model_s_adapters_table(tmp_path):
    from mlxd.daemon import cli

    config = tmp_path / "c.toml"
    config.write_text('[model]\nadapters = { sql = "/a/sql" }\n')
    argv = ["serve", "m", "--config", str(config), "--adapter", "chat=~/chat"]
    settings = cli.effective_settings(cli._parser().parse_args(argv))
    (entry,) = settings.model_entries()
    assert entry.adapters == {"sql": "/a/sql", "chat": "~/chat"}  # the flag adds to the file's


@pytest.mark.parametrize("value", ["sql", "=/a", "sql=", " = "])
def test_an_adapter_flag_is_name_equals_dir(value, capsys):
    from mlxd.daemon import cli

    with pytest.raises(SystemExit):
        cli._parser().parse_args(["serve", "m", "--adapter", value])
    assert "NAME=DIR" in capsys.readouterr().err


def test_an_adapter_flag_names_an_adapter_once():
    from mlxd.daemon import cli

    args = cli._parser().parse_args(["serve", "m", "--adapter", "a=/x", "--adapter", "a=/y"])
    with pytest.raises(SettingsError, match="'a' given twice"):
        cli.effective_settings(args)


def _models(*entries: dict, **model) -> dict:
    return {"models": list(entries), "model": model}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (_models({"id": "a", "adapters": {"b": "/x"}}, {"id": "b"}), "'b' .*is a model's id"),
        (
            _models({"id": "a", "adapters": {"x": "/1"}}, {"id": "b", "adapters": {"x": "/2"}}),
            "'x' is named twice",
        ),
        (_models({"id": "a", "adapters": {"": "/x"}}), "empty or padded adapter id"),
        (_models({"id": "a", "adapters": {" x": "/x"}}), "empty or padded adapter id"),
        (_models({"id": "a", "adapters": {"x": ""}}), "adapter 'x' has no path"),
        (
            _models({"id": "e", "kind": "embedding", "adapters": {"x": "/x"}}),
            "embedding model takes no LoRA adapters",
        ),
        (_models({"id": "a"}, adapters={"x": "/x"}), "give each entry its own adapters"),
        ({"model": {"adapters": {"x": ""}}}, "adapter 'x' has no path"),
        ({"model": {"served_id": "x", "adapters": {"x": "/x"}}}, "'x' .*is a model's id"),
        ({"model": {"max_adapters": 0}}, "max_adapters"),
    ],
)
def test_adapter_ids_are_unique_named_and_have_a_path(overrides, message):
    with pytest.raises(SettingsError, match=message):
        load_settings(overrides=overrides)


def test_a_models_entry_s_adapters_and_limits():
    s = load_settings(
        overrides=_models({"id": "a", "adapters": {"x": "/x"}, "max_adapters": 2}, {"id": "b"})
    )
    a, b = s.model_entries()
    assert (a.adapters, a.max_adapters, b.adapters, b.max_adapters) == ({"x": "/x"}, 2, {}, 0)


def test_an_environment_variable_sets_the_adapters_table_as_json():
    env = {"MLXD_MODEL__ADAPTERS": '{"sql": "/a/sql"}'}
    assert load_settings(environ=env).model.adapters == {"sql": "/a/sql"}
