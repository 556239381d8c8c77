"""Config loading: precedence, origins, precise errors, rendering and schema."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from ridethrough.config import ConfigError, FrozenMap, Loaded, env_var, json_schema, load, mask_dsn, render
from ridethrough.settings import (
    COMPONENTS,
    AgentConfig,
    GatewayConfig,
    ServerConfig,
    load_component,
    parse_hostport,
)

SECTIONS = tuple(COMPONENTS)


@dataclass(frozen=True, slots=True, kw_only=True)
class Toy:
    """A model that exercises every framework feature."""

    name: str = field(default="n", metadata={"help": "a name"})
    count: int = field(default=3, metadata={"help": "a count", "min": 1, "max": 10})
    ratio: float = field(default=0.5, metadata={"help": "a ratio", "min": 0})
    verbose: bool = field(default=False, metadata={"help": "talk more"})
    mode: str = field(default="fast", metadata={"help": "a mode", "choices": ("fast", "safe")})
    kinds: tuple[str, ...] = field(default=("a",), metadata={"help": "kinds", "choices": ("a", "b", "c")})
    tags: Mapping[str, str] = field(default=FrozenMap(), metadata={"help": "tags"})
    token: str = field(default="", metadata={"help": "an API token", "secret": True})
    low: int = field(default=0, metadata={"help": "lower end"})
    high: int = field(default=5, metadata={"help": "upper end"})

    def __post_init__(self) -> None:
        if self.low > self.high:
            raise ValueError(f"low ({self.low}) must not exceed high ({self.high})")


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "ridethrough.yaml"
    path.write_text(text)
    return path


def load_toy(
    *,
    file: Path | None = None,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, object] | None = None,
) -> Loaded[Toy]:
    return load(Toy, component="toy", file=file, env={} if env is None else env, flags=flags)


def error_of(**kwargs: Any) -> str:
    with pytest.raises(ConfigError) as info:
        load_toy(**kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


# -- defaults and precedence ----------------------------------------------------------------


@pytest.mark.parametrize("component", SECTIONS)
def test_defaults_load_with_default_origins(component: str) -> None:
    loaded = load_component(component, env={})
    assert loaded.config == COMPONENTS[component]()
    assert set(loaded.origins.values()) == {"default"}
    assert set(loaded.origins) == {f.name for f in dataclasses.fields(COMPONENTS[component])}


def test_default_values_match_the_design() -> None:
    gateway = GatewayConfig()
    assert gateway.otlp_listen == "127.0.0.1:4317"
    assert gateway.max_message_bytes == 16 * 1024 * 1024
    assert gateway.spool_max_bytes == 1024**3
    agent = AgentConfig()
    assert agent.sources == ("netdev", "infiniband", "ethtool", "gpu", "job", "probe")
    assert agent.node_id == ""  # the composition root fills in the host name
    assert dict(agent.labels) == {}
    assert ServerConfig().store_http_listen == "127.0.0.1:0"


def test_flag_beats_env_beats_file_beats_default(tmp_path: Path) -> None:
    path = write(tmp_path, "toy:\n  name: from-file\n  count: 4\n  ratio: 1\n")
    env = {"RIDETHROUGH_TOY_COUNT": "5", "RIDETHROUGH_TOY_RATIO": "2.5"}
    loaded = load(Toy, component="toy", file=path, env=env, flags={"ratio": 3.0, "mode": None})
    assert (loaded.config.name, loaded.config.count, loaded.config.ratio) == ("from-file", 5, 3.0)
    assert loaded.config.mode == "fast"  # a None flag was not given
    assert loaded.origins["name"] == f"file:{path}"
    assert loaded.origins["count"] == "env:RIDETHROUGH_TOY_COUNT"
    assert loaded.origins["ratio"] == "flag"
    assert loaded.origins["mode"] == "default"


def test_flags_may_be_strings_or_typed() -> None:
    config = load_toy(flags={"count": "7", "verbose": "on", "kinds": ["b", "c"], "tags": "k=v"}).config
    assert (config.count, config.verbose, config.kinds) == (7, True, ("b", "c"))
    assert config.tags == {"k": "v"} and isinstance(config.tags, FrozenMap)


def test_unknown_flag_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="nmae") as info:
        load_toy(flags={"nmae": "x"})
    assert not isinstance(info.value, ConfigError)


def test_missing_section_and_empty_file_are_fine(tmp_path: Path) -> None:
    assert load_toy(file=write(tmp_path, "other: {}\n")).config == Toy()
    assert load_toy(file=write(tmp_path, "")).config == Toy()
    assert load_toy(file=write(tmp_path, "toy:\n")).config == Toy()


def test_file_holds_sections_for_every_component(tmp_path: Path) -> None:
    path = write(tmp_path, "agent:\n  rack: r7\ngateway:\n  workers: 2\nserver:\n  store_http_listen: ''\n")
    assert load_component("agent", file=path, env={}).config.rack == "r7"
    assert load_component("gateway", file=path, env={}).config.workers == 2
    assert load_component("server", file=path, env={}).config.store_http_listen == ""


# -- unknown names --------------------------------------------------------------------------


def test_unknown_key_in_file_names_path_line_and_suggestion(tmp_path: Path) -> None:
    path = write(tmp_path, "gateway:\n  workers: 2\n  otlp_listn: 0.0.0.0:4317\n")
    with pytest.raises(ConfigError) as info:
        load_component("gateway", file=path, env={})
    assert str(info.value) == f"gateway: unknown key 'otlp_listn' in {path}:3 (did you mean 'otlp_listen'?)"


def test_unknown_env_var_with_the_component_prefix_is_an_error() -> None:
    with pytest.raises(ConfigError) as info:
        load_component("gateway", env={"RIDETHROUGH_GATEWAY_OTLP_LISTN": "0.0.0.0:1"})
    assert str(info.value) == (
        "gateway: unknown environment variable RIDETHROUGH_GATEWAY_OTLP_LISTN "
        "(did you mean RIDETHROUGH_GATEWAY_OTLP_LISTEN?)"
    )


def test_env_vars_of_other_components_are_ignored() -> None:
    loaded = load_component("agent", env={"RIDETHROUGH_GATEWAY_WORKERS": "x", "HOME": "/root"})
    assert set(loaded.origins.values()) == {"default"}


def test_unknown_section_is_an_error(tmp_path: Path) -> None:
    path = write(tmp_path, "agent: {}\ngatway:\n  workers: 2\n")
    with pytest.raises(ConfigError) as info:
        load_component("agent", file=path, env={})
    assert str(info.value) == f"unknown section 'gatway' in {path}:2 (did you mean 'gateway'?)"


def test_unknown_component() -> None:
    with pytest.raises(ConfigError, match=r"unknown component 'gatway'.*did you mean 'gateway'\?"):
        load_component("gatway")


def test_duplicate_key_in_file_is_an_error(tmp_path: Path) -> None:
    path = write(tmp_path, "toy:\n  count: 2\n  count: 3\n")
    assert error_of(file=path) == f"config file {path}:3: duplicate key 'toy.count'"


# -- bad values -----------------------------------------------------------------------------


def test_wrong_type_in_file_names_key_and_origin(tmp_path: Path) -> None:
    path = write(tmp_path, "toy:\n  name: n\n  count: '5'\n")
    assert error_of(file=path) == f"toy.count: expected an integer, got '5' (string) (in {path}:3)"


def test_file_values_are_checked_strictly(tmp_path: Path) -> None:
    assert "got True (boolean)" in error_of(file=write(tmp_path, "toy: {count: yes}\n"))
    assert "expected a list of strings" in error_of(file=write(tmp_path, "toy: {kinds: a}\n"))
    assert "expected a mapping of strings" in error_of(file=write(tmp_path, "toy: {tags: {k: 1}}\n"))
    assert "expected a string, got None (null)" in error_of(file=write(tmp_path, "toy: {name: }\n"))
    config = load_toy(file=write(tmp_path, "toy: {ratio: 2}\n")).config
    assert config.ratio == 2.0 and isinstance(config.ratio, float)  # an int is a fine number


def test_wrong_type_in_env_names_key_and_variable() -> None:
    assert error_of(env={"RIDETHROUGH_TOY_RATIO": "fast"}) == (
        "toy.ratio: expected a number, got 'fast' (from env RIDETHROUGH_TOY_RATIO)"
    )
    with pytest.raises(ConfigError) as info:
        load_component("agent", env={"RIDETHROUGH_AGENT_INTERVAL_S": "fast"})
    assert str(info.value) == (
        "agent.interval_s: expected a number, got 'fast' (from env RIDETHROUGH_AGENT_INTERVAL_S)"
    )


@pytest.mark.parametrize(("text", "expected"), [("1_000", 1000), (" 42 ", 42), ("-3", -3)])
def test_int_from_env(text: str, expected: int) -> None:
    env = {"RIDETHROUGH_TOY_LOW": text, "RIDETHROUGH_TOY_HIGH": "10000"}
    assert load_toy(env=env).config.low == expected


@pytest.mark.parametrize("text", ["1.5", "1e3", "0x10", "", "ten"])
def test_int_from_env_rejects_non_integers(text: str) -> None:
    assert "expected an integer" in error_of(env={"RIDETHROUGH_TOY_LOW": text})


@pytest.mark.parametrize("text", ["nan", "inf", "", "1,5"])
def test_float_from_env_rejects_non_finite_or_malformed(text: str) -> None:
    assert "expected a number" in error_of(env={"RIDETHROUGH_TOY_RATIO": text})


@pytest.mark.parametrize(
    ("text", "expected"),
    [("true", True), ("TRUE", True), ("1", True), ("yes", True), ("On", True),
     ("false", False), ("0", False), ("no", False), ("OFF", False)],
)
def test_bool_from_text(text: str, expected: bool) -> None:
    assert load_toy(env={"RIDETHROUGH_TOY_VERBOSE": text}).config.verbose is expected


@pytest.mark.parametrize("text", ["", "2", "y", "enabled"])
def test_bool_from_text_rejects_other_words(text: str) -> None:
    message = error_of(env={"RIDETHROUGH_TOY_VERBOSE": text})
    assert message.startswith(f"toy.verbose: expected a boolean (true/false), got {text!r}")


@pytest.mark.parametrize(
    ("text", "expected"), [("a, b ,c", ("a", "b", "c")), ("", ()), ("b,", ("b",)), (" c ", ("c",))]
)
def test_tuple_from_env(text: str, expected: tuple[str, ...]) -> None:
    assert load_toy(env={"RIDETHROUGH_TOY_KINDS": text}).config.kinds == expected


def test_mapping_from_env() -> None:
    loaded = load_component("agent", env={"RIDETHROUGH_AGENT_LABELS": "rack=r1, zone = z=2,"})
    assert loaded.config.labels["rack"] == "r1"
    assert dict(loaded.config.labels) == {"rack": "r1", "zone": "z=2"}
    assert load_toy(env={"RIDETHROUGH_TOY_TAGS": ""}).config.tags == {}


@pytest.mark.parametrize("text", ["novalue", "=v", "k=1,k=2"])
def test_mapping_from_env_rejects_bad_items(text: str) -> None:
    assert "expected a mapping of strings to strings" in error_of(env={"RIDETHROUGH_TOY_TAGS": text})


def test_min_and_max() -> None:
    assert error_of(env={"RIDETHROUGH_TOY_COUNT": "0"}) == (
        "toy.count: must be >= 1, got 0 (from env RIDETHROUGH_TOY_COUNT)"
    )
    assert error_of(flags={"count": 11}) == "toy.count: must be <= 10, got 11 (from flag)"
    assert error_of(flags={"ratio": -0.1}) == "toy.ratio: must be >= 0, got -0.1 (from flag)"


def test_choices_for_scalars_and_tuple_items() -> None:
    assert error_of(flags={"mode": "saf"}) == (
        "toy.mode: must be one of fast, safe; got 'saf' (did you mean 'safe'?) (from flag)"
    )
    assert "got 'd'" in error_of(env={"RIDETHROUGH_TOY_KINDS": "a,d"})


def test_post_init_value_error_names_the_component() -> None:
    assert error_of(flags={"low": 6}) == "toy: low (6) must not exceed high (5)"
    with pytest.raises(ConfigError, match=r"^gateway: replay_initial_backoff_s \(60.0\) must not exceed"):
        load_component("gateway", env={"RIDETHROUGH_GATEWAY_REPLAY_INITIAL_BACKOFF_S": "60"})


def test_field_check_errors_name_key_and_origin() -> None:
    with pytest.raises(ConfigError) as info:
        load_component("gateway", env={"RIDETHROUGH_GATEWAY_METRICS_LISTEN": "localhost"})
    assert str(info.value) == (
        "gateway.metrics_listen: expected HOST:PORT, got 'localhost' "
        "(from env RIDETHROUGH_GATEWAY_METRICS_LISTEN)"
    )


def test_store_dsn_scheme_is_checked_and_its_password_not_echoed() -> None:
    with pytest.raises(ConfigError) as info:
        load_component("gateway", env={"RIDETHROUGH_GATEWAY_STORE": "mysql://u:hunter2@db:3306/x"})
    assert "gateway.store: expected chdb://PATH" in str(info.value)
    assert "hunter2" not in str(info.value) and "u:***@db" in str(info.value)


@pytest.mark.parametrize("value", [["hunter2"], 12345678])
def test_bad_secret_value_is_not_echoed(value: object) -> None:
    expected = "toy.token: invalid value (not shown: secret field) (from flag)"
    assert error_of(flags={"token": value}) == expected


def test_bad_dsn_in_a_list_is_not_echoed(tmp_path: Path) -> None:
    path = write(tmp_path, "gateway:\n  store: [http://u:hunter2@h/db]\n")
    with pytest.raises(ConfigError) as info:
        load_component("gateway", file=path, env={})
    assert str(info.value) == f"gateway.store: expected a string, got a list (in {path}:2)"


# -- files ----------------------------------------------------------------------------------


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    assert error_of(file=path) == f"config file {path}: not found"


def test_yaml_syntax_error_names_path_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "toy:\n  name: a\n  count: [1, 2\n")
    message = error_of(file=path)
    assert re.match(rf"config file {re.escape(str(path))}:\d+:\d+: invalid YAML: ", message), message


def test_yaml_syntax_error_line_is_the_bad_line(tmp_path: Path) -> None:
    path = write(tmp_path, "toy:\n  name: a\n bad: b\n")
    assert error_of(file=path).startswith(f"config file {path}:3:")


def test_file_that_is_not_a_mapping(tmp_path: Path) -> None:
    assert "expected a mapping of sections, got list" in error_of(file=write(tmp_path, "- a\n- b\n"))
    assert "toy: expected a mapping of settings" in error_of(file=write(tmp_path, "toy: 3\n"))


# -- rendering and schema -------------------------------------------------------------------


def test_render_shows_value_and_origin_per_field() -> None:
    loaded = load_component("agent", env={"RIDETHROUGH_AGENT_RACK": "r9"}, flags={"interval_s": 0.5})
    lines = render(loaded, component="agent").splitlines()
    assert lines[0] == "# agent"
    rows = {line.split()[0]: line.split() for line in lines[2:]}
    assert rows["rack"] == ["rack", '"r9"', "env:RIDETHROUGH_AGENT_RACK"]
    assert rows["interval_s"] == ["interval_s", "0.5", "flag"]
    assert rows["sources"][-1] == "default"
    assert set(rows) == {f.name for f in dataclasses.fields(AgentConfig)}
    assert len({line.index(" default") for line in lines if line.endswith(" default")}) == 1  # aligned


def test_render_masks_secrets_and_dsn_passwords() -> None:
    toy = load_toy(flags={"token": "hunter2"})
    assert "hunter2" not in render(toy, component="toy")
    assert "***" in render(toy, component="toy")
    dsn = "https://ingest:s3cr3t@ch.example:8443/telemetry"
    out = render(load_component("gateway", env={"RIDETHROUGH_GATEWAY_STORE": dsn}), component="gateway")
    assert "s3cr3t" not in out
    assert "https://ingest:***@ch.example:8443/telemetry" in out


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("http://u:p@h:8123/db", "http://u:***@h:8123/db"),
        ("http://u:p/w@h/db", "http://u:***@h/db"),
        ("http://u@h/db", "http://u@h/db"),
        ("chdb://.ridethrough/store", "chdb://.ridethrough/store"),
        ("http://h/db?user=u&password=p&x=1", "http://h/db?user=u&password=***&x=1"),
    ],
)
def test_mask_dsn(url: str, expected: str) -> None:
    assert mask_dsn(url) == expected


@pytest.mark.parametrize("model", [*COMPONENTS.values(), Toy])
def test_json_schema_describes_every_field(model: type) -> None:
    schema = json_schema(model)
    assert schema["type"] == "object"
    assert schema["additionalProperties"] is False
    assert set(schema["properties"]) == {f.name for f in dataclasses.fields(model)}
    for name, prop in schema["properties"].items():
        assert prop["description"], name
        assert "default" in prop, name


def test_json_schema_types_and_constraints() -> None:
    props = json_schema(Toy)["properties"]
    assert props["count"] == {"type": "integer", "description": "a count", "default": 3, "minimum": 1,
                              "maximum": 10}
    assert props["kinds"]["items"] == {"type": "string", "enum": ["a", "b", "c"]}
    assert props["kinds"]["default"] == ["a"]
    assert props["tags"]["additionalProperties"] == {"type": "string"}
    assert props["mode"]["enum"] == ["fast", "safe"]
    assert props["verbose"]["type"] == "boolean"
    assert props["ratio"]["type"] == "number"
    assert props["token"]["writeOnly"] is True
    assert json_schema(AgentConfig)["properties"]["labels"]["default"] == {}


# -- helpers and models ---------------------------------------------------------------------


def test_env_var() -> None:
    assert env_var("gateway", "otlp_listen") == "RIDETHROUGH_GATEWAY_OTLP_LISTEN"


@pytest.mark.parametrize(
    ("text", "expected"),
    [("127.0.0.1:4317", ("127.0.0.1", 4317)), ("[::1]:0", ("::1", 0)), ("gw.svc:65535", ("gw.svc", 65535)),
     ("0.0.0.0:0", ("0.0.0.0", 0))],
)
def test_parse_hostport_accepts(text: str, expected: tuple[str, int]) -> None:
    assert parse_hostport(text) == expected


@pytest.mark.parametrize(
    "text", ["", "host", ":4317", "host:", "host:65536", "host:-1", "host:http", "::1:80", "[::1]", "[]:1",
             "h ost:1", "host:\uff14\uff13"],
)
def test_parse_hostport_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="expected"):
        parse_hostport(text)


@pytest.mark.parametrize("component", SECTIONS)
def test_configs_are_frozen_and_hashable(component: str) -> None:
    config = COMPONENTS[component]()
    name = dataclasses.fields(config)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(config, name, "x")
    assert hash(config) == hash(COMPONENTS[component]())


def test_agent_labels_from_a_plain_dict_are_frozen() -> None:
    agent = AgentConfig(labels={"rack": "r1"})
    assert isinstance(agent.labels, FrozenMap) and agent.labels["rack"] == "r1"
    with pytest.raises(TypeError):
        agent.labels["rack"] = "r2"  # type: ignore[index]  # mutation is what this test proves impossible
    hash(agent)


def test_every_component_field_has_help() -> None:
    for model in COMPONENTS.values():
        for f in dataclasses.fields(model):
            assert f.metadata.get("help"), f"{model.__name__}.{f.name}"


def test_agent_control_plane_fields_load_from_env_and_check_their_tls_pairs(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    loaded = load_component("agent", env={"RIDETHROUGH_AGENT_CONTROL_KEYS_FILE": str(keys),
                                          "RIDETHROUGH_AGENT_CONTROL_KEY_IDS": "k1,k2",
                                          "RIDETHROUGH_AGENT_JOB_RUN_DIR": "/run/jobs"})
    cfg = loaded.config
    assert (cfg.control_listen, cfg.control_keys_file, cfg.control_key_ids, cfg.job_run_dir) == \
        ("0.0.0.0:7450", str(keys), ("k1", "k2"), "/run/jobs")
    assert loaded.origins["control_keys_file"] == "env:RIDETHROUGH_AGENT_CONTROL_KEYS_FILE"
    with pytest.raises(ConfigError, match="control_tls_cert_file and control_tls_key_file go together"):
        load_component("agent", env={"RIDETHROUGH_AGENT_CONTROL_TLS_CERT_FILE": "c.pem"})
    with pytest.raises(ConfigError, match="mutual TLS"):
        load_component("agent", env={"RIDETHROUGH_AGENT_CONTROL_TLS_CLIENT_CA_FILE": "ca.pem"})
    with pytest.raises(ConfigError, match="control_listen"):
        load_component("agent", env={"RIDETHROUGH_AGENT_CONTROL_LISTEN": "no-port"})
