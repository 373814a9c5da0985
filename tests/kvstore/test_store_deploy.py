"""The store as `deepinfer up` runs it (no Ray needed here): the stages' default is the embedded store in a
persistent per-cluster directory (`$DEEPINFER_HOME/kvstore/<name>`, kept across `down` / `up`) unless the YAML or
`--kv-store-dir` names another, `fresh` (a per-start directory that goes with its cluster) or `off`; the decode
stage shares the prefill stage's store; `deepinfer store stats|evict|clear` on a recorded cluster's store, a
cluster's default store or a given --dir; the store's figures for `deepinfer status`."""

from __future__ import annotations

import os

import pytest

from deepinfer.deploy import cli
from deepinfer.deploy.config import ClusterConfig, cluster_store_dir, fresh_store_root, is_fresh_store_dir
from deepinfer.deploy.launcher import write_state
from deepinfer.kvstore import KVStore, KVStoreConfig, chain_keys


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPINFER_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("DEEPINFER_CLUSTER", raising=False)
    return tmp_path / "home"


def _prefill(config: ClusterConfig):
    return config.role_config("prefill", instance_id="prefill-0", lb_address="127.0.0.1:1")


def _fill(directory: str, n: int, traffic_class: str) -> None:
    store = KVStore(KVStoreConfig(directories=(directory,)), start_threads=False)
    keys = chain_keys(os.urandom(16), list(range(n * 64)), 64)
    for i, k in enumerate(keys):
        assert store.put(k, keys[i - 1] if i else None, bytes(4096), traffic_class)
    store.close()


def _decode(config: ClusterConfig):
    return config.role_config("decode", instance_id="decode-0", lb_address="127.0.0.1:1")


def test_up_defaults_to_a_persistent_store_per_cluster(tmp_path, home):
    a, b = ClusterConfig(), ClusterConfig()
    pa = _prefill(a)
    assert pa.kv_store == "embedded" and pa.kv_store_dirs == a.kv_store_dir == str(home / "kvstore" / "deepinfer")
    assert a.kv_store_dir == b.kv_store_dir == str(cluster_store_dir("deepinfer"))  # the next start finds it
    assert ClusterConfig(name="other").kv_store_dir == str(home / "kvstore" / "other")  # one per cluster name
    assert not is_fresh_store_dir(a.kv_store_dir)
    # the decode stage writes conversation turns into the same store
    da = _decode(a)
    assert (da.kv_store, da.kv_store_dirs) == ("embedded", a.kv_store_dir)
    # the controller gets the config as JSON: it (and every instance it starts) sees the same directory
    assert _prefill(ClusterConfig.model_validate_json(a.model_dump_json())).kv_store_dirs == a.kv_store_dir
    # a YAML naming the directory keeps it; the worker's own dirs win (and decode follows the prefill's)
    named = ClusterConfig(kv_store_dir=str(tmp_path / "ssd"))
    assert _prefill(named).kv_store_dirs == str(tmp_path / "ssd") and not is_fresh_store_dir(named.kv_store_dir)
    two = ClusterConfig(prefill={"balancer": {"policy": "prefix_store_aware"},
                                 "worker": {"kv_store_dirs": "/ssd0,/ssd1"}})
    assert _prefill(two).kv_store == "embedded" and _prefill(two).kv_store_dirs == "/ssd0,/ssd1"
    assert _decode(two).kv_store_dirs == "/ssd0,/ssd1"
    # fresh: a per-start directory, another at each start (removed when the cluster goes down)
    f1, f2 = ClusterConfig(kv_store_dir="fresh"), ClusterConfig(kv_store_dir="fresh")
    assert is_fresh_store_dir(f1.kv_store_dir) and f1.kv_store_dir != f2.kv_store_dir
    assert fresh_store_root() == home / "clusters" / "kvstore" and _decode(f1).kv_store_dirs == f1.kv_store_dir
    # off: prefill worker settings (YAML's unquoted `off` is false), or the cluster's kv_store_dir (both stages)
    yaml = tmp_path / "off.yaml"
    yaml.write_text("prefill:\n  balancer: {policy: prefix_aware}\n  worker: {kv_store: off}\n")
    off = ClusterConfig.load(yaml)
    assert _prefill(off).kv_store == "off" and _decode(off).kv_store == "off"
    assert cli._kv_store_dirs(off) == "" and cli._kv_store_dirs(a) == a.kv_store_dir
    yaml.write_text("kv_store_dir: off\n")
    off = ClusterConfig.load(yaml)
    assert _prefill(off).kv_store == "off" and _decode(off).kv_store == "off" and cli._kv_store_dirs(off) == ""
    # a decode stage may keep its own store settings (here: none)
    own = ClusterConfig(decode={"balancer": {"policy": "kv_load"}, "worker": {"kv_store": "off"}})
    assert _decode(own).kv_store == "off" and _prefill(own).kv_store == "embedded"


def test_up_flags_choose_the_store_dir(tmp_path, home):
    parser = cli.build_parser()

    def config(*argv):
        return cli._config_from_args(parser.parse_args(["up", *argv]), parser)

    assert config().kv_store_dir == str(cluster_store_dir("deepinfer"))
    assert config("--name", "blue").kv_store_dir == str(cluster_store_dir("blue"))  # the default follows --name
    assert config("--kv-store-dir", str(tmp_path / "s")).kv_store_dir == str(tmp_path / "s")
    assert is_fresh_store_dir(config("--kv-store-dir", "fresh").kv_store_dir)
    assert _prefill(config("--kv-store-dir", "off")).kv_store == "off"
    named = tmp_path / "named.yaml"
    named.write_text(f"kv_store_dir: {tmp_path / 'yaml-dir'}\n")
    assert config("--config", str(named), "--name", "x").kv_store_dir == str(tmp_path / "yaml-dir")


def test_store_command_on_a_recorded_cluster_and_on_a_dir(tmp_path, capsys):
    config = ClusterConfig(name="kv-test")
    _fill(config.kv_store_dir, 3, "agent")
    write_state({"name": "kv-test", "status": "up", "kv_store_dir": cli._kv_store_dirs(config)})
    assert cli.main(["store", "stats"]) == 0  # the only recorded cluster
    out = capsys.readouterr().out
    assert "3 blocks" in out and "agent" in out and "ttl 3.0 d" in out
    figures = cli._store_figures("kv-test")  # what `deepinfer status` appends
    assert figures["blocks"] == 3 and figures["classes"]["agent"]["ttl_s"] == 3 * 86400
    assert cli.main(["store", "evict", "--name", "kv-test", "--bytes", "0.000001"]) == 0
    assert "evicted 1" in capsys.readouterr().out
    assert cli.main(["store", "clear", "--name", "kv-test"]) == 0
    assert "cleared 2" in capsys.readouterr().out
    # a cluster that is not up: its default store outlives it
    down = ClusterConfig(name="kv-down")
    _fill(down.kv_store_dir, 1, "chat")
    assert cli.main(["store", "stats", "--name", "kv-down"]) == 0 and "1 blocks" in capsys.readouterr().out

    other = str(tmp_path / "other")
    _fill(other, 2, "chat")
    assert cli.main(["store", "stats", "--dir", other, "--json"]) == 0
    assert '"chat"' in capsys.readouterr().out
    # a directory that does not exist is reported, not created; a cluster with no store is named
    assert cli.main(["store", "stats", "--dir", str(tmp_path / "none")]) == 1 and not (tmp_path / "none").exists()
    write_state({"name": "no-store", "status": "up", "kv_store_dir": ""})
    assert cli.main(["store", "stats", "--name", "no-store"]) == 1
    assert "no embedded KV store" in capsys.readouterr().err
    assert cli._store_figures("no-store") is None


def test_a_fresh_store_goes_with_its_cluster_a_named_one_stays(tmp_path):
    fresh = ClusterConfig(kv_store_dir="fresh").kv_store_dir
    named = str(tmp_path / "keep")
    _fill(fresh, 1, "chat")
    _fill(named, 1, "chat")
    cli._remove_fresh_store(f"{fresh},{named}")
    assert not os.path.exists(fresh) and os.path.isdir(named)
    assert not fresh_store_root().parent.exists()  # nothing left in $DEEPINFER_HOME (the demo test checks it)
