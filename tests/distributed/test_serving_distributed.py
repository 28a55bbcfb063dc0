"""Serving checkpoints of distributed jobs: a persia job's (tables on PS shards) and a PICASSO
job's (shards written by the trainers) export, batch-predict, serve and `eval --predictions` to
the same scores; and the predictor as a Ray Serve deployment answers as `hybridrec serve` does."""
import subprocess
import sys

import numpy as np
import pytest
import yaml
from helpers import JOB_SECONDS, PredictionServer, predictions, write_config, write_test_rows

from hybridrec.bundle import chain
from hybridrec.bundle.format import complete_versions, read_manifest
from hybridrec.cli import main
from hybridrec.serving.export import export
from hybridrec.config import load_config

pytest.importorskip("uvicorn", reason="hybridrec serve needs hybridrec[serve]")


def _small_job(tmp_path, strategy: dict, **train):
    config = write_config(tmp_path, **train)
    data = yaml.safe_load(config.read_text())
    data["data"]["synthetic"].update(train_rows=8_000, test_rows=1_500)
    data["strategy"] = strategy
    config.write_text(yaml.safe_dump(data))
    done = subprocess.run([sys.executable, "-m", "hybridrec.cli", "train", str(config), "--overwrite"],
                          capture_output=True, text=True, timeout=JOB_SECONDS)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return load_config(config)


@pytest.mark.parametrize("strategy", [
    {"preset": "persia", "tau": 2, "roles": {"ps_servers": 2, "embedding_workers": 1, "trainers": 2}},
    {"preset": "picasso", "roles": {"trainers": 2}},
], ids=["persia", "picasso"])
def test_predict_serve_and_eval_agree_on_a_distributed_checkpoint(tmp_path, strategy):
    cfg = _small_job(tmp_path, strategy)
    run = cfg.train.output_dir
    shards = list((tmp_path / "run" / "checkpoints").glob("step-*/embeddings/shard-*"))
    assert len(shards) == 2  # the tables were written by the shards, not in the local layout
    rows = write_test_rows(cfg, tmp_path / "test.tsv")
    assert main(["export", run, "--out", str(tmp_path / "bundle")]) == 0
    assert main(["eval", "--checkpoint", run, "--predictions", str(tmp_path / "eval.csv")]) == 0
    assert main(["predict", str(tmp_path / "bundle"), "--data", str(rows), "--out", str(tmp_path / "p.csv")]) == 0
    expected = predictions(tmp_path / "eval.csv")[1]
    got = predictions(tmp_path / "p.csv")[1]
    assert got.shape == expected.shape == (1500, 1)
    assert np.abs(got - expected).max() <= 1e-5
    server = PredictionServer(tmp_path / "bundle")
    try:
        status, answer = server.post("/predict", {"lines": rows.read_text().splitlines()[:300]})
    finally:
        server.stop()
    assert status == 200 and np.abs(np.array(answer["scores"]) - expected[:300, 0]).max() <= 1e-5


def test_a_picasso_job_publishes_versions_that_end_with_its_checkpointed_model(tmp_path):
    """Every trainer copies its shard of every table (hot rows written back), the leader writes."""
    cfg = _small_job(tmp_path, {"preset": "picasso", "roles": {"trainers": 2}},
                     publish_dir=str(tmp_path / "pub"), publish_every=4, publish_full_every=3)
    versions = complete_versions(tmp_path / "pub")
    assert [read_manifest(p)["kind"] for p in versions.values()][:4] == ["full", "delta", "delta", "full"]
    newest = chain.load(versions[max(versions)])
    exported = chain.load(export(cfg.train.output_dir, tmp_path / "bundle"))
    assert newest.step == exported.step
    for name, table in exported.tables.items():
        mine = newest.tables[name]
        order, theirs = np.argsort(table.keys), np.argsort(mine.keys)
        np.testing.assert_array_equal(table.keys[order], mine.keys[theirs])
        np.testing.assert_array_equal(table.weights()[order], mine.weights()[theirs])


def test_the_predictor_as_a_ray_serve_deployment_answers_as_hybridrec_serve(tmp_path):
    pytest.importorskip("ray.serve", reason="serve --ray needs hybridrec[ray]")
    from helpers import PublishingJob

    job = PublishingJob(tmp_path)
    job.train(3)
    job.publish()
    job.publisher.wait()
    lines = write_test_rows(job.cfg, tmp_path / "rows.tsv").read_text().splitlines()[:40]
    plain = PredictionServer(job.publisher.root)
    try:
        expected = plain.post("/predict", {"lines": lines})[1]["scores"]
    finally:
        plain.stop()
    served = PredictionServer(job.publisher.root, "--ray", "auto", "--replicas", "2", seconds=180)
    try:
        for _ in range(4):  # requests spread over both replicas
            status, answer = served.post("/predict", {"lines": lines})
            assert status == 200 and answer["version"] == 1
            assert np.abs(np.array(answer["scores"]) - expected).max() <= 1e-6
        assert served.post("/predict", {"rows": [{"nope": 1}]})[0] == 400
        assert served.get("/health")[0] == 200
    finally:
        served.stop()
