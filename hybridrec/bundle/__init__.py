"""Inference bundles: what a trained model is once it leaves training, in files.

A bundle version is a directory that scores raw rows without the training job: per table the
keys and their weights only (fp32, fp16 or row-wise int8), the dense model's architecture and
weights, the feature pipeline (how raw columns become keys and dense inputs) and a manifest with
the version, the training step, the stream position and every file's checksum. A version is
either full or a delta on the version before it (rows changed since, keys removed, the dense
weights). `format.py` writes and reads versions atomically, `precision.py` quantizes rows,
`features.py` turns raw rows into batches, `tables.py` serves a version's tables (hash lookup,
pooling, applying deltas), `chain.py` resolves a directory of versions.
"""
