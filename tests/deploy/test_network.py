"""The cluster network as `host:` (issue 31: the production YAMLs bound every internal service to 0.0.0.0):
a network resolves to this node's address in it, a node with none is refused before anything starts,
and the production YAMLs bind the cluster network, not every interface."""

from __future__ import annotations

from pathlib import Path

import pytest

from deepinfer.deploy import cli
from deepinfer.deploy.config import ClusterConfig
from deepinfer.deploy.network import is_loopback_host, is_network, resolve_host

CONFIGS = Path(__file__).resolve().parents[2] / "deploy" / "configs"


def test_a_network_resolves_to_this_node_s_address_in_it():
    assert resolve_host("127.0.0.0/8") == "127.0.0.1"  # the loopback interface is in every node's list
    assert resolve_host("10.0.0.0/8", addresses=["192.168.1.2", "fe80::1", "10.1.2.3"]) == "10.1.2.3"
    assert resolve_host("fd00::/8", addresses=["10.1.2.3", "fd12::7"]) == "fd12::7"
    for host in ("127.0.0.1", "0.0.0.0", "localhost", "node-3.cluster"):
        assert resolve_host(host) == host and not is_network(host)
    with pytest.raises(RuntimeError, match=r"host 10\.0\.0\.0/8: no interface .* 192\.168\.1\.2"):
        resolve_host("10.0.0.0/8", addresses=["192.168.1.2"])


def test_loopback_networks_keep_ucx_on_loopback():
    assert is_loopback_host("127.0.0.0/8") and is_loopback_host("::1") and is_loopback_host("localhost")
    assert not is_loopback_host("10.0.0.0/8") and not is_loopback_host("0.0.0.0")
    config = ClusterConfig(host="127.0.0.0/8")
    assert config.is_loopback and config.role_config("decode", instance_id="d", lb_address="h:1").loopback_ucx


def test_production_configs_bind_the_cluster_network():
    for name in ("one_node_8gpu.yaml", "two_datacenters.yaml"):
        config = ClusterConfig.load(CONFIGS / name)
        assert is_network(config.host) and config.host != "0.0.0.0", name
        assert not config.role_config("prefill", instance_id="p", lb_address="h:1").loopback_ucx


def test_up_on_a_network_this_node_is_not_in_is_refused_before_anything_starts(tmp_path, monkeypatch, capsys):
    from deepinfer.deploy.launcher import list_states

    monkeypatch.setenv("DEEPINFER_HOME", str(tmp_path))
    monkeypatch.delenv("DEEPINFER_CLUSTER", raising=False)
    code = cli.main(["up", "--host", "203.0.113.0/24"])  # TEST-NET-3: no machine has an interface there
    err = capsys.readouterr().err
    assert code == 1 and "203.0.113.0/24" in err and "no interface" in err and "Traceback" not in err
    assert not list_states()
