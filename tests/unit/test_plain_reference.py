"""scripts/plain_reference.py: the benchmarks' plain-vLLM copy of the reference differs from it only in its port,
its log and the executor-queue calming, and carries the API key's variable name, never its value."""

import importlib.util
import sys
from pathlib import Path

import pytest

import pdctl
from pdctl.protocol import QUEUE_SPIN_ENV
from pdctl.topology import Override

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"


def _script():
    spec = importlib.util.spec_from_file_location("pdctl_plain_reference", ROOT / "scripts" / "plain_reference.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_the_plain_reference_is_the_reference_uncalmed_on_its_own_port():
    with_plain_reference = _script().with_plain_reference
    p = pdctl.plan(pdctl.load(CONFIGS / "cpu-demo.yaml"), reference_port=8300)
    both = with_plain_reference(p, 8301)
    ref, plain = both.get("reference"), both.get("reference-plain")
    assert QUEUE_SPIN_ENV in ref.env and QUEUE_SPIN_ENV not in plain.env
    assert plain.http_url.endswith(":8301") and plain.readiness_url.endswith(":8301/health")
    assert plain.argv[plain.argv.index("--port") + 1] == "8301" and plain.log_path.endswith("reference-plain.log")
    rest = [a for a in plain.argv if a != "8301"]
    assert rest == [a for a in ref.argv if a != "8300"]  # nothing else differs
    with pytest.raises(KeyError):
        with_plain_reference(pdctl.plan(pdctl.load(CONFIGS / "cpu-demo.yaml")), 8301)  # no reference to copy


def test_the_plain_reference_carries_the_keys_variable_name():
    name = "PDCTL_TEST_KEY"
    t = pdctl.load(CONFIGS / "cpu-demo.yaml", [Override.parse_set(f"auth.api_key_env={name}")])
    plain = _script().with_plain_reference(pdctl.plan(t, reference_port=8300), 8391).get("reference-plain")
    assert plain.secret_env == {"VLLM_API_KEY": name} and "--api-key" not in plain.argv
