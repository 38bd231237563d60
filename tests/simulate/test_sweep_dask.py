"""moelab sweep --dask: the same rows from a Dask distributed cluster as from local processes."""
import csv

from distributed import LocalCluster

from moelab.simulate_cli import sweep_main


def _rows(path):
    with open(path, newline="") as f:
        return {r["key"]: r for r in csv.DictReader(f)}


def test_dask_cluster_gives_the_local_rows(tmp_path):
    args = ["--tokens", "8", "--policies", "lru,hybrid", "--cache-slots", "8,16", "--miss-fractions", "0.25"]
    assert sweep_main(args + ["--out", str(tmp_path / "local"), "--jobs", "1"]) == 0
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster:
        assert sweep_main(args + ["--out", str(tmp_path / "dask"), "--dask", cluster.scheduler_address]) == 0
    local, remote = _rows(tmp_path / "local" / "results.csv"), _rows(tmp_path / "dask" / "results.csv")
    assert len(local) == 4 and local.keys() == remote.keys()
    for key, row in local.items():
        assert row["error"] == "" and remote[key]["tokens_per_s"] == row["tokens_per_s"]
        assert remote[key]["upload_bytes"] == row["upload_bytes"]
