"""pdctl.proxy.config: the proxy's whole configuration as one model, from the plan's --spec or from flags."""

import pytest

import pdctl
import pdctl.api
from pdctl.proxy.config import ProxyConfig, moved_upstreams, spec_of, with_spec


@pytest.fixture
def served(monkeypatch):
    from pdctl.proxy import server

    got: list = []
    monkeypatch.setattr(server, "serve", got.append)
    return got


def test_a_spec_and_the_same_flags_give_the_same_configuration(served):
    up = {"prefill": ["p32=http://h:1", "p64=http://h:3"], "decode": ["d64=http://h:2", "d32=http://h:4"]}
    same = {"policy": "round_robin", "connect_timeout_s": 3.0, "weights": {"decode/d64": 2.0},
            "exclude_pairs": [("p64", "d32")]}
    cfg = ProxyConfig(**up, **same)
    pdctl.api.serve_proxy(spec=cfg.to_spec())
    pdctl.api.serve_proxy(up["prefill"], up["decode"], **same, first_token=None)  # None: the model's default
    assert served[0] == served[1] == cfg
    assert "affinity" not in cfg.to_spec()  # defaults are not written: the model holds them


def test_a_spec_holds_everything_so_a_flag_beside_it_is_refused(served):
    spec = ProxyConfig(decode=["http://h:2"]).to_spec()
    with pytest.raises(pdctl.UserError, match="--spec holds the whole configuration: drop --decode, --connect-timeout"):
        pdctl.api.serve_proxy(None, ["http://h:3"], spec=spec, connect_timeout_s=1.0)
    assert served == []


@pytest.mark.parametrize("how,said", [
    ({"decode": ["http://h:2"], "connect_timeout_s": 0}, "--connect-timeout: Input should be greater than 0"),
    ({"decode": []}, "--decode: List should have at least 1 item"),
    ({"decode": ["http://h:2"], "first_token": "always"}, "--first-token: Input should be 'off', 'on' or 'auto'"),
    ({"spec": '{"decode": ["http://h:2"], "policy": "random"}'}, "policy: Input should be"),
    ({"spec": "{not json"}, "proxy: Invalid JSON"),
])
def test_a_bad_configuration_is_refused_naming_the_flag_or_the_field(served, how, said):
    decode = how.pop("decode", None)
    with pytest.raises(pdctl.UserError, match=said.replace("(", r"\(")):
        pdctl.api.serve_proxy(None, decode, **how)
    assert served == []


def test_moving_upstreams_keeps_pools_and_the_rest(served):
    cfg = ProxyConfig(prefill=["p32=http://a:1", "http://b:1"], decode=["http://c:2"], policy="round_robin")
    out = moved_upstreams(cfg, {"http://a:1": "http://x:1", "http://c:2": "http://y:2"})
    assert out.prefill == ["p32=http://x:1", "http://b:1"] and out.decode == ["http://y:2"]
    assert out.policy == "round_robin"
    argv = ["python", "-m", "pdctl", "proxy", "--spec", cfg.to_spec()]
    assert spec_of(with_spec(argv, out)) == out and with_spec(argv, out)[:5] == argv[:5]


def test_first_token_takes_a_bare_on_or_off_as_the_word_and_is_off_by_default():
    assert ProxyConfig(decode=["http://h:2"]).first_token == "off"
    assert ProxyConfig(prefill=["http://h:1"], decode=["http://h:2"], first_token=True).first_token == "on"
    assert ProxyConfig(prefill=["http://h:1"], decode=["http://h:2"], first_token=False).first_token == "off"
