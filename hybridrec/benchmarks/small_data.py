"""`hybridrec bench small-data`: do the defaults learn on a small file of one's own?

For each seed, a planted tabular CSV (hybridrec.data.planted_table: string categoricals with
empty cells, numerics with gaps) is written; its last 20% of rows are the test rows. hybridrec
trains LR and DeepFM from a config that names only the data, the schema and the model (every
other setting is a default: batch size, learning rates, validation split, early stopping,
standardisation), and scikit-learn's LogisticRegression (one-hot categoricals with missing as
a category, mean-imputed standardised numerics, default C) is fitted on the same training rows
as the peer. Printed: each test AUC, the median difference to scikit-learn per model, and the
planted model's AUC (the best achievable).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

MODELS = ("lr", "deepfm")
TEST_FRACTION = 0.2


def own_data_config(path: Path, model: str, output_dir: Path, seed: int) -> dict:
    """What a new user writes: the data, the schema, the model."""
    from hybridrec.data.planted_table import PlantedTable

    return {"seed": seed,
            "data": {"format": "tabular", "path": str(path), "test_fraction": TEST_FRACTION,
                     "schema": PlantedTable.schema()},
            "model": {"name": model},
            "train": {"output_dir": str(output_dir), "progress": False}}


def hybridrec_auc(path: Path, model: str, output_dir: Path, seed: int, overrides: list[str] = ()) -> dict:
    """Test AUC and run facts of a hybridrec job with the defaults on `path`."""
    import contextlib
    import io

    from hybridrec.config import apply_overrides, parse_config
    from hybridrec.train.trainer import train

    data, applied = apply_overrides(own_data_config(path, model, output_dir, seed), list(overrides))
    with contextlib.redirect_stdout(io.StringIO()):
        result = train(parse_config(data, overrides=applied), overwrite=True)
    return {"auc": result["auc"], "steps": result["step"],
            "best_step": (result.get("best_valid") or {}).get("step")}


def sklearn_auc(path: Path, seed: int) -> float:
    """Test AUC of scikit-learn's logistic regression on one-hot + standardised columns."""
    import numpy as np
    import pandas as pd
    from sklearn.compose import ColumnTransformer
    from sklearn.impute import SimpleImputer
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import roc_auc_score
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import OneHotEncoder, StandardScaler

    from hybridrec.data.planted_table import CATEGORICAL, LABEL, NUMERIC

    frame = pd.read_csv(path, dtype={c: str for c in CATEGORICAL})
    frame[list(CATEGORICAL)] = frame[list(CATEGORICAL)].fillna("(missing)")
    test = int(round(len(frame) * TEST_FRACTION))
    train, held = frame.iloc[:len(frame) - test], frame.iloc[len(frame) - test:]
    columns = ColumnTransformer([("categorical", OneHotEncoder(handle_unknown="ignore"), list(CATEGORICAL)),
                                 ("numeric", make_pipeline(SimpleImputer(), StandardScaler()), list(NUMERIC))])
    fitted = make_pipeline(columns, LogisticRegression(max_iter=2000, random_state=seed))
    fitted.fit(train[list(CATEGORICAL + NUMERIC)], train[LABEL].to_numpy())
    scores = fitted.predict_proba(held[list(CATEGORICAL + NUMERIC)])[:, 1]
    return float(roc_auc_score(np.asarray(held[LABEL]), scores))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hybridrec bench small-data", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=5_000, help="rows per generated file (the last 20%% test)")
    p.add_argument("--seeds", type=int, default=3, help="generated files (and training seeds) 0..N-1")
    p.add_argument("--models", default=",".join(MODELS), help="hybridrec models to train, comma-separated")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config change for every hybridrec run (to compare settings with the defaults)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


def headline(report: dict) -> dict:
    figures = {f"{m} AUC - sklearn LR AUC (median)": round(report["median_gap"][m], 4) for m in report["median_gap"]}
    figures["sklearn LR AUC (median)"] = round(statistics.median(r["sklearn"] for r in report["runs"]), 4)
    return figures


def main(argv: list[str] | None = None) -> dict:
    from hybridrec.data.planted_table import write_planted_table
    from hybridrec.train.reporting import json_text

    args = _parser().parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    runs = []
    with tempfile.TemporaryDirectory(prefix="hybridrec-small-data-") as tmp:
        for seed in range(args.seeds):
            table = write_planted_table(Path(tmp) / f"table-{seed}.csv", args.rows, seed=seed,
                                        test_fraction=TEST_FRACTION)
            run = {"seed": seed, "planted": table.planted_auc, "sklearn": sklearn_auc(table.path, seed)}
            for model in models:
                run[model] = hybridrec_auc(table.path, model, Path(tmp) / f"run-{seed}-{model}", seed, args.set)
            runs.append(run)
            print(f"seed {seed}: planted {run['planted']:.4f}  sklearn LR {run['sklearn']:.4f}  "
                  + "  ".join(f"{m} {run[m]['auc']:.4f} ({run[m]['steps']} steps, best {run[m]['best_step']})"
                              for m in models), flush=True)
    gaps = {m: statistics.median(r[m]["auc"] - r["sklearn"] for r in runs) for m in models}
    report = {"rows": args.rows, "seeds": args.seeds, "test_fraction": TEST_FRACTION, "overrides": args.set,
              "runs": runs, "median_gap": gaps}
    print("median test AUC difference to scikit-learn's LogisticRegression: "
          + ", ".join(f"{m} {g:+.4f}" for m, g in gaps.items()))
    if args.json:
        print(json_text(report, indent=1))
    return report
