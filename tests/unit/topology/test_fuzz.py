"""Any input, never a traceback: the topology loader and the override parser meet arbitrary bytes, arbitrary YAML,
real configs with a random field set to a random value of a random type, and arbitrary flags. The only exception
allowed is TopologyError, and its message names the file (or the flag the value came from). The CLI turns every
bad-input kind into exit 1 with the file named and no traceback.

Budgets are small (the file runs in well under a minute); `.hypothesis/` keeps failing examples between runs."""

from __future__ import annotations

import atexit
import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdctl import yamlsrc
from pdctl.plan import build_plan
from pdctl.topology import (
    Override,
    TopologyError,
    load_topology,
)
from tests.conftest import CONFIGS, REPO

TINY_CONFIG = Path(__file__).parents[1] / "bad" / "models" / "tiny"  # a config.json only: the rules read nothing else
TINY_HYBRID_CONFIG = TINY_CONFIG.with_name("tiny-hybrid")
# PDCTL_FUZZ_EXAMPLES=5000 for a long hunt; the default keeps the unit tests quick.
EXAMPLES = int(os.environ.get("PDCTL_FUZZ_EXAMPLES", "120"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
WORK = Path(tempfile.mkdtemp(prefix="pdctl-fuzz-"))
atexit.register(shutil.rmtree, WORK, ignore_errors=True)


def _topologies() -> dict[str, dict]:
    """Every example topology in configs/, with the tiny model's path pointing at the corpus' config.json."""
    out = {}
    for f in sorted(CONFIGS.glob("*.yaml")):
        data = yaml.safe_load(f.read_text())
        if isinstance(data, dict) and "prefill" in data:
            if "tiny-hybrid" in str(data["model"].get("path")):
                data["model"]["path"] = str(TINY_HYBRID_CONFIG)
            elif "tiny" in str(data["model"].get("path")):
                data["model"]["path"] = str(TINY_CONFIG)
            out[f.name] = data
    return out


TOPOLOGIES = _topologies()


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    """Every place in a document (mappings' keys and list items, at every depth)."""
    out = [prefix] if prefix else []
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*prefix, i))
    return out


PATHS = {name: _paths(doc) for name, doc in TOPOLOGIES.items()}


def _check(fn, *names: str) -> Any:
    """Run fn: success, or a TopologyError whose message names one of `names`; anything else fails the test."""
    try:
        return fn()
    except TopologyError as e:
        text = str(e)
        assert any(n in text for n in names), f"none of {names} in:\n{text}"
        assert "Traceback" not in text
        return e


def _write(name: str, content: bytes | str) -> Path:
    path = WORK / name
    if isinstance(content, str):
        content = content.encode("utf-8", "surrogatepass")
    path.write_bytes(content)
    return path


def _plan_too(loaded) -> None:
    """A topology that validates must also plan (pdctl plan, pdctl up)."""
    if loaded is not None and not isinstance(loaded, TopologyError):
        build_plan(loaded.topology, base_dir=loaded.base_dir, state_dir=WORK / "state", python=sys.executable)


# ----------------------------------------------------------------------------------------------------------------
# Strategies

scalars = (st.none() | st.booleans() | st.integers() | st.integers(min_value=-2**70, max_value=2**70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=40)
           | st.sampled_from(["", "cpu", "cuda", "HND", "NHD", "nixl", "pdctl", "256MiB", "1e400", "0x10", "~",
                              "-1", "99999999999999999999999999999GiB", "127.0.0.1", "[]", "{}", "a: b", "*a",
                              "&a", "!!int x", "\x00", "\udcff", "${HOME}", "../" * 30, "~nosuchuser/m"]))
keys = st.text(max_size=12) | st.sampled_from(
    ["name", "model", "prefill", "decode", "proxy", "connector", "engine", "supervision", "path", "block_size",
     "tp", "count", "devices", "kv_layout", "platform", "http_port", "kv_cache_memory", "env", "extra_args"])
values = st.recursive(scalars, lambda children: st.lists(children, max_size=5)
                      | st.dictionaries(keys | st.integers(), children, max_size=5), max_leaves=25)


def _dump(doc: Any) -> str:
    return yaml.safe_dump(doc, allow_unicode=False, default_flow_style=None, sort_keys=False)


# ----------------------------------------------------------------------------------------------------------------
# The loader


@FUZZ
@given(st.binary(max_size=400))
def test_random_bytes(raw):
    path = _write("bytes.yaml", raw)
    _check(lambda: load_topology(path), str(path))


@FUZZ
@given(st.text(max_size=300))
def test_random_text(text):
    path = _write("text.yaml", text)
    _check(lambda: load_topology(path), str(path))


@FUZZ
@given(values)
def test_random_yaml(doc):
    path = _write("random.yaml", _dump(doc))
    _check(lambda: load_topology(path), str(path))


@FUZZ
@given(st.fixed_dictionaries({"name": values, "model": values, "prefill": values, "decode": values},
                             optional={"proxy": values, "connector": values, "engine": values,
                                       "supervision": values}))
def test_random_topology_shaped_yaml(doc):
    path = _write("shaped.yaml", _dump(doc))
    _check(lambda: load_topology(path), str(path))


@FUZZ  # each example loads and plans a real topology (~20 ms): twice the budget took 4.0-5.7 s here, at the limit
@given(st.data())
def test_real_configs_with_a_random_field_set_to_a_random_value(data):
    name = data.draw(st.sampled_from(sorted(TOPOLOGIES)))
    doc = copy.deepcopy(TOPOLOGIES[name])
    for _ in range(data.draw(st.integers(1, 3))):
        where = data.draw(st.sampled_from(_paths(doc) or [("name",)]))
        node = doc
        for k in where[:-1]:
            node = node[k]
        if data.draw(st.booleans()) or not isinstance(node, dict):
            node[where[-1]] = data.draw(values)
        else:
            del node[where[-1]]
    path = _write(name, _dump(doc))
    _plan_too(_check(lambda: load_topology(path), str(path)))


@FUZZ
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
                    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=10), c, max_size=4),
                    max_leaves=20),
       st.fixed_dictionaries({}, optional={
           **{k: st.integers(-3, 2**41) | st.text(max_size=5) | st.none()
              for k in ("num_hidden_layers", "num_key_value_heads", "head_dim", "num_attention_heads", "hidden_size",
                        "max_position_embeddings", "sliding_window", "kv_lora_rank", "sliding_window_pattern",
                        "max_window_layers")},
           "layer_types": st.lists(st.sampled_from(["sliding_attention", "full_attention", "linear_attention", 1,
                                                    None]), max_size=6) | st.text(max_size=5),
           "model_type": st.sampled_from(["llama", "gemma2", "qwen2"])}),
       st.sampled_from(["1KiB", "2MiB", "256MiB", 1, 2**40]), st.integers(1, 8))
def test_random_model_config(extra, cfg, memory, tp):
    """config.json feeds the TP and capacity rules: any content, any numbers."""
    model = WORK / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(cfg if isinstance(extra, bool) else {**cfg, "extra": extra}))
    doc = {"name": "t", "model": {"path": str(model)}, "prefill": {"block_size": 128, "devices": [0]},
           "decode": {"block_size": 32, "tp": tp, "kv_cache_memory": memory, "devices": list(range(1, tp + 1))}}
    path = _write("cfg.yaml", _dump(doc))
    _plan_too(_check(lambda: load_topology(path), str(path)))


@pytest.mark.parametrize("name", sorted(TOPOLOGIES))
@pytest.mark.parametrize("value", [None, -1, float("nan"), "text", [1, "a"], {"x": 1}, 2**70], ids=repr)
def test_wrong_type_at_every_field(name, value):
    for where in PATHS[name]:
        doc = copy.deepcopy(TOPOLOGIES[name])
        node = doc
        for k in where[:-1]:
            node = node[k]
        node[where[-1]] = value
        path = _write(f"typed-{name}", _dump(doc))
        _plan_too(_check(lambda p=path: load_topology(p), str(path)))


# ----------------------------------------------------------------------------------------------------------------
# Overrides

flag_text = st.text(max_size=30) | st.sampled_from(
    ["64", "0", "-1", "abc", "[1, 2]", "{a: 1}", "1e9", "ray", "HND", "~", "", " ", "[" * 100, "&a [*a]",
     "!!int x", "!!python/object:os.system", "99999999999999999999", "12" * 3000])
set_key = st.text(max_size=20) | st.sampled_from(
    ["decode.block_size", "prefill.block_size", "prefill.tp", "decode.tp", "decode.kv_layout", "prefill.count",
     "decode.count", "engine.kind", "engine.address", "reference.port",
     "prefill.0.tp", "decode.d64.block_size", "proxy.port", "model.path", "name",
     "connector.extra_config.x", "prefill.block_size.x", "decode.99.tp", "engine.placement.prefill.node",
     "prefill.devices.0", "decode.²", "decode." + "9" * 50, "..", "prefill.env.X", "decode.kv_cache_memory"])


@FUZZ
@given(st.text(max_size=60) | st.builds(lambda k, v: f"{k}={v}", set_key, flag_text))
def test_parse_set(text):
    _check(lambda: Override.parse_set(text), f"--set {text}")


@FUZZ
@given(st.lists(st.builds(lambda k, v: f"{k}={v}", set_key, flag_text), max_size=4),
       st.sampled_from(["cpu-demo.yaml", "cpu-fleet.yaml", "qwen3-0.6b-cuda-d64.yaml", "cpu-hybrid.yaml"]))
def test_overrides_on_real_configs(sets, name):
    names = [f"--set {s}" for s in sets]
    overrides = _check(lambda: [Override.parse_set(s) for s in sets], *names)
    if isinstance(overrides, TopologyError):
        return
    path = CONFIGS / name
    _plan_too(_check(lambda: load_topology(path, overrides), str(path), *names))


# ----------------------------------------------------------------------------------------------------------------
# The bounds themselves: refused quickly, with a message


def _bomb(levels: int = 9) -> str:
    lines = ["a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for i in range(1, levels):
        prev, cur = chr(96 + i), chr(97 + i)
        lines.append(f"{cur}: &{cur} [" + ", ".join([f"*{prev}"] * 9) + "]")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("text,expect", [
    (_bomb(), "more than 20000 values"),
    ("[" * 10000 + "]" * 10000, "nested more than 64 levels"),
    ("{a: " * 10000 + "1" + "}" * 10000, "nested more than 64 levels"),
    ("".join(" " * i + f"k{i}:\n" for i in range(2000)), "nested more than 64 levels"),
    ("- " * 5000 + "x\n", "nested more than 64 levels"),
    ("a: &a [1, *a]\n", "recursive structure"),
    ("a: &a {b: *a}\n", "recursive structure"),
    ("- 1\n" * 30000, "more than 20000 values"),
], ids=["billion-laughs", "deep-flow-lists", "deep-flow-maps", "deep-block-maps", "deep-block-lists",
        "recursive-list", "recursive-map", "many-values"])
def test_bounds(text, expect):
    start = time.monotonic()
    with pytest.raises(yamlsrc.YamlLimitError, match=expect):
        yamlsrc.load(text)
    assert time.monotonic() - start < 10  # quick: refused as it is read, never expanded


def test_bounds_in_overrides():
    for value in (_bomb().replace("\n", ", ").join("{}"), "[" * 5000):
        e = _check(lambda v=value: Override.parse_set(f"connector.extra_config={v}"), "--set connector.extra_config=")
        assert isinstance(e, TopologyError)


def test_anchors_and_aliases_still_work(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text("name: t\nmodel: {path: m/m}\nprefill: &pool {block_size: 32, devices: [0]}\n"
                    "decode: *pool\n")
    assert load_topology(path).topology.decode[0].block_size == 32


def test_file_size_limit_refuses_before_reading(tmp_path):
    path = tmp_path / "huge.yaml"
    with open(path, "wb") as f:
        f.truncate(11 * 2**20)  # sparse: 11 MiB that take no disk
    with pytest.raises(TopologyError, match=r"huge.yaml: .*the topology is 11 MiB, more than the 1 MiB"):
        load_topology(path)


def test_unreadable_file(tmp_path, monkeypatch, run_cli):
    """chmod 000 does not stop root (the tests' user): the permission error is simulated where the file is opened."""
    path = tmp_path / "secret.yaml"
    path.write_text("name: t\n")
    real_open = os.open

    def deny(p, *a, **kw):
        if os.fspath(p) == os.fspath(path):
            raise PermissionError(13, "Permission denied", os.fspath(p))
        return real_open(p, *a, **kw)

    monkeypatch.setattr(os, "open", deny)
    with pytest.raises(TopologyError, match=r"secret.yaml: .*cannot read the topology: Permission denied"):
        load_topology(path)
    code, out, err = run_cli("validate", path)
    assert code == 1 and "Traceback" not in out + err and f"{path}: (top level): cannot read the topology" in err


def test_utf16_with_bom_is_read(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_bytes("name: t\nmodel: {path: m/m}\nprefill: {devices: [0]}\ndecode: {devices: [1]}\n".encode("utf-16"))
    assert load_topology(path).topology.name == "t"


# ----------------------------------------------------------------------------------------------------------------
# The CLI: every bad-input kind is exit 1 (2 for usage), the file or flag named, never a traceback


def _bad_inputs(tmp: Path) -> dict[str, Path]:
    made = {
        "binary": b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe\x00",
        "not-utf8": b"name: t\nmodel: {path: caf\xe9}\n",
        "empty": b"",
        "bomb": _bomb().encode(),
        "deep": b"[" * 10000 + b"]" * 10000,
        "wrong-types": b"name: [1]\nmodel: 5\nprefill: {block_size: {a: 1}, tp: x, devices: 3}\ndecode: []\n",
        "unsafe-tag": b"name: !!python/object/apply:os.system [ls]\n",
        "nul-char": b"name: t\x00\n",
    }
    out = {}
    for kind, content in made.items():
        out[kind] = tmp / f"{kind}.yaml"
        out[kind].write_bytes(content)
    out["directory"] = tmp / "adir.yaml"
    out["directory"].mkdir()
    out["fifo"] = tmp / "fifo.yaml"  # nobody writes to it: read as empty, never a hang
    os.mkfifo(out["fifo"])
    out["missing"] = tmp / "missing.yaml"
    out["huge"] = tmp / "huge.yaml"
    with open(out["huge"], "wb") as f:
        f.truncate(11 * 2**20)
    out["unreadable"] = tmp / "loop.yaml"  # a symlink loop: unreadable even for root
    out["unreadable"].symlink_to(out["unreadable"])
    return out


KINDS = ["binary", "not-utf8", "empty", "bomb", "deep", "wrong-types", "unsafe-tag", "nul-char", "directory", "fifo",
         "missing", "huge", "unreadable"]


@pytest.mark.parametrize("command", ["validate", "plan"])
@pytest.mark.parametrize("kind", KINDS)
def test_cli_bad_input(run_cli, tmp_path, command, kind):
    path = _bad_inputs(tmp_path)[kind]
    code, out, err = run_cli(command, path)
    assert code in (1, 2), (out, err)
    assert "Traceback" not in out + err
    assert str(path) in err, err


@pytest.mark.parametrize("args,named", [
    (["--set", "prefill.tp=" + "[" * 500], "--set prefill.tp"),
    (["--set", "connector.extra_config=" + _bomb().replace("\n", ", ").join("{}")], "--set connector.extra_config"),
    (["--set", "decode.²=1"], "--set decode.²=1"),
    (["--set", "=1"], "--set =1"),
    (["--set", "decode.block_size=" + "12" * 3000], "--set decode.block_size"),
    (["--set", "decode.kv_cache_memory=" + "9" * 400 + "GiB"], "--set decode.kv_cache_memory"),
    (["--set", "model.path=~nosuchuser/m"], "cpu-demo.yaml"),
])
@pytest.mark.parametrize("command", ["validate", "plan"])
def test_cli_bad_flags(run_cli, command, args, named):
    code, out, err = run_cli(command, CONFIGS / "cpu-demo.yaml", *args)
    assert code in (0, 1, 2), (out, err)
    assert "Traceback" not in out + err
    if code:
        assert named in err, err


def test_cli_subprocess_odd_file_name(tmp_path):
    """A real process: a file name that is not UTF-8, holding bytes that are not either."""
    name = os.fsencode(tmp_path) + b"/caf\xe9.yaml"
    with open(name, "wb") as f:
        f.write(b"\xff\xfe\xfd not yaml \x00")
    for command in ("validate", "plan"):
        r = subprocess.run([sys.executable, "-m", "pdctl", command, name], capture_output=True, cwd=REPO, timeout=120)
        assert r.returncode == 1, r
        assert b"Traceback" not in r.stdout + r.stderr
        assert b"caf" in r.stderr and b".yaml" in r.stderr, r.stderr

