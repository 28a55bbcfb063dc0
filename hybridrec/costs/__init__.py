"""The throughput cost model and its calibration: `hybridrec calibrate` measures this machine's
per-operation costs (calibrate.py), and the model predicts a job's samples/s on a described
cluster from them (model.py); `hybridrec bench speedups --calibration` validates it."""
