"""Serving a trained model: export, predict, eval --predictions and the HTTP server agree on the
scores of the same rows; int8 keeps the AUC; bad input is refused in one line and the server
stays up; versions swap under load without a failed request and roll back."""
import json
import sys
import threading

import numpy as np
import pytest
from helpers import PredictionServer, predictions, small_config, write_test_rows

from hybridrec.bundle import chain
from hybridrec.bundle.precision import dequantize, quantize
from hybridrec.cli import main
from hybridrec.metrics import MetricAccumulator

pytest.importorskip("uvicorn", reason="hybridrec serve needs hybridrec[serve]")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A small local DeepFM run, its test rows as a data file and its fp32 / int8 bundles."""
    from hybridrec.train.trainer import train

    root = tmp_path_factory.mktemp("serving")
    cfg = small_config(root, **{"data.synthetic.train_rows": 12_000, "data.synthetic.test_rows": 3_000})
    train(cfg)
    rows = write_test_rows(cfg, root / "test.tsv")
    for precision in ("fp32", "int8"):
        assert main(["export", cfg.train.output_dir, "--out", str(root / f"bundle-{precision}"),
                     "--precision", precision]) == 0
    return cfg, root, rows


def test_quantized_rows_stay_within_half_a_step():
    rng = np.random.default_rng(0)
    weights = (rng.normal(size=(500, 16)) * rng.uniform(0.01, 3, size=(500, 1))).astype(np.float32)
    arrays = quantize(weights, "int8")
    step = arrays["scale"].view(np.float16).astype(np.float32)
    error = np.abs(dequantize(arrays, "int8") - weights).max(axis=1)
    assert (error <= step * 0.5 + np.abs(weights).max(axis=1) * 2e-3).all()  # + fp16 rounding of the bias
    assert np.abs(dequantize(quantize(weights, "fp16"), "fp16") - weights).max() < 2e-3 * np.abs(weights).max()
    assert arrays["codes"].nbytes == weights.nbytes // 4


def test_predict_equals_eval_predictions_and_int8_keeps_the_auc(trained, tmp_path):
    cfg, root, rows = trained
    assert main(["eval", "--checkpoint", cfg.train.output_dir, "--predictions", str(tmp_path / "eval.csv")]) == 0
    assert main(["predict", str(root / "bundle-fp32"), "--data", str(rows), "--out", str(tmp_path / "p.csv")]) == 0
    header, expected = predictions(tmp_path / "eval.csv")
    got_header, got = predictions(tmp_path / "p.csv")
    assert header == got_header == ["score"]
    assert got.shape == expected.shape == (3000, 1)
    assert np.abs(got - expected).max() <= 1e-5
    assert main(["predict", str(root / "bundle-int8"), "--data", str(rows), "--out", str(tmp_path / "q.csv")]) == 0
    labels = np.loadtxt(rows, delimiter="\t", usecols=0)[:, None].astype(np.float32)
    auc = {}
    for name, scores in (("fp32", got), ("int8", predictions(tmp_path / "q.csv")[1])):
        acc = MetricAccumulator(1)
        acc.update(scores.astype(np.float32), labels)
        auc[name] = acc.compute()["auc"]
    assert auc["fp32"] > 0.6 and abs(auc["int8"] - auc["fp32"]) <= 0.001, auc


def test_predict_reads_rows_without_a_label_or_with_an_empty_one(trained, tmp_path):
    cfg, root, rows = trained
    lines = rows.read_text().splitlines()[:50]
    (tmp_path / "none.tsv").write_text("\n".join(line.split("\t", 1)[1] for line in lines) + "\n")
    (tmp_path / "empty.tsv").write_text("\n".join("\t" + line.split("\t", 1)[1] for line in lines[:-1])
                                        + "\nnot\ta\trow\n")
    bundle = str(root / "bundle-fp32")
    assert main(["predict", bundle, "--data", str(rows), "--out", str(tmp_path / "all.csv")]) == 0
    assert main(["predict", bundle, "--data", str(tmp_path / "none.tsv"), "--out", str(tmp_path / "n.csv")]) == 0
    assert main(["predict", bundle, "--data", str(tmp_path / "empty.tsv"), "--out", str(tmp_path / "e.csv")]) == 0
    whole = predictions(tmp_path / "all.csv")[1][:50]
    np.testing.assert_allclose(predictions(tmp_path / "n.csv")[1], whole, rtol=0, atol=1e-6)  # other batch sizes
    empty = predictions(tmp_path / "e.csv")[1]
    assert empty.shape == (50, 1) and np.isnan(empty[-1, 0])  # the bad row keeps its line, with no score
    np.testing.assert_allclose(empty[:-1], whole[:-1], rtol=0, atol=1e-6)
    assert main(["predict", bundle, "--data", str(tmp_path / "empty.tsv"), "--out", str(tmp_path / "s.csv"),
                 "--strict"]) == 2


def test_served_scores_equal_batch_predictions_and_bad_requests_get_400(trained, tmp_path):
    cfg, root, rows = trained
    assert main(["predict", str(root / "bundle-fp32"), "--data", str(rows), "--out", str(tmp_path / "p.csv")]) == 0
    expected = predictions(tmp_path / "p.csv")[1][:, 0]
    lines = rows.read_text().splitlines()
    columns = ["label"] + [f"I{i}" for i in range(1, 14)] + [f"C{i}" for i in range(1, 27)]
    server = PredictionServer(root / "bundle-fp32")
    try:
        status, answer = server.post("/predict", {"lines": lines[:700]})
        assert status == 200 and answer["version"] == 1
        assert np.abs(np.array(answer["scores"]) - expected[:700]).max() <= 1e-5
        rows_json = [{c: (int(v) if c.startswith("I") and v else v or None) for c, v in zip(columns, line.split("\t"))
                      if c != "label"} for line in lines[700:760]]
        status, answer = server.post("/predict", {"rows": rows_json})
        assert status == 200 and np.abs(np.array(answer["scores"]) - expected[700:760]).max() <= 1e-5
        bad = [(None, b"{not json"), ({"rows": [{"C1": "a", "nope": 1}]}, None), ({"rows": [{"I1": "x"}]}, None),
               ({"rows": [{"C2": {"a": 1}}]}, None), ({"lines": [1, 2]}, None), ({"rows": []}, None),
               ({"lines": ["1\t2\t3"]}, None), ({"rows": [{}], "lines": []}, None), ([1, 2], None)]
        for body, raw in bad:
            status, answer = server.post("/predict", body, raw)
            assert status == 400 and "\n" not in answer["error"] and answer["error"], (body, answer)
        assert oversized_request(server.url) == 400  # answered before the body is read
        assert server.get("/health") == (200, {"status": "ok", "version": 1})
        status, text = server.get("/metrics")
        assert status == 200 and 'hybridrec_requests_total{code="400",endpoint="predict"} 10.0' in text
        assert "hybridrec_id_lookups_missing_total" in text and "hybridrec_version 1.0" in text
    finally:
        server.stop()


def oversized_request(url: str) -> int:
    """The status of a POST /predict declaring a 17 MiB body, of which only the start is sent."""
    import socket

    host, port = url.split("//")[1].split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n{\"lines\": [\"" % (17 << 20))
        answer = sock.recv(4096)
    return int(answer.split(b" ", 2)[1])


def test_unknown_ids_score_with_zero_rows_as_evaluation_does(trained):
    cfg, root, _ = trained
    from hybridrec.serving.predictor import Predictor

    predictor = Predictor(chain.load(root / "bundle-fp32"))
    text = "\t".join(["1"] * 13 + ["deadbeef"] * 26).encode()
    batch = predictor.features.parse_request_lines(text, 1, "lines")
    pooled = predictor.pooled(batch)
    assert not pooled["deep"].any() and not pooled["wide"].any()
    assert predictor.counts() == (52, 52)


def test_a_token_is_required_when_the_job_has_a_key(trained, monkeypatch):
    import os

    from hybridrec.comm.auth import JobKey

    cfg, root, rows = trained
    key = JobKey.new()
    server = PredictionServer(root / "bundle-fp32", env={**os.environ, "HYBRIDREC_AUTH_KEY": key.secret})
    try:
        line = rows.read_text().splitlines()[0]
        assert server.post("/predict", {"lines": [line]})[0] == 401
        server.headers = {"Authorization": f"Bearer {key.http_token()}"}
        assert server.post("/predict", {"lines": [line]})[0] == 200
    finally:
        server.stop()


def test_the_prediction_server_is_a_role_a_supervisor_runs(trained, tmp_path):
    """The role table's prediction server under the launchers' supervisor: ready once it serves,
    answering /health, with the job key's token required for predictions, stopped with the job."""
    from hybridrec.parallel.roles import prediction_server_role
    from hybridrec.parallel.supervisor import OK, Role, Supervisor

    _, root, _ = trained
    serve = prediction_server_role(str(root / "bundle-fp32"))
    url = f"http://127.0.0.1:{serve.argv[serve.argv.index('--port') + 1]}"
    probe = ("import sys, urllib.request, urllib.error\n"
             f"assert urllib.request.urlopen('{url}/health', timeout=30).status == 200\n"
             "try:\n"
             f"    urllib.request.urlopen(urllib.request.Request('{url}/predict', data=b'{{}}', method='POST'),"
             " timeout=30)\n"
             "except urllib.error.HTTPError as error:\n"
             "    sys.exit(0 if error.code == 401 else error.code)\n"
             "sys.exit(1)\n")
    out = tmp_path / "out.log"
    with out.open("w") as log:
        supervisor = Supervisor([serve, Role("probe", [sys.executable, "-c", probe], main=True)], out=log, grace=10)
        assert supervisor.run(timeout=240) == OK, out.read_text()[-3000:]
    assert "[serve] hybridrec serve: version" in out.read_text()
