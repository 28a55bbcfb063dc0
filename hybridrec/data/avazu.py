"""Reader of the Avazu click logs (CSV with header: id, click, hour, C1, banner_pos, site_*,
app_*, device_*, C14..C21).

The label is `click`; every other column except `id` is a categorical feature hashed per
field; `hour` (YYMMDDHH) becomes two features, `hour:hour_of_day` and `hour:day_of_week`
(or stays one categorical with `split_hour=False`). There are no dense features.
"""
from __future__ import annotations

from hybridrec.data.tabular import DelimitedTextReader, TabularSchema

AVAZU_COLUMNS = (
    "id", "click", "hour", "C1", "banner_pos", "site_id", "site_domain", "site_category",
    "app_id", "app_domain", "app_category", "device_id", "device_ip", "device_model",
    "device_type", "device_conn_type", "C14", "C15", "C16", "C17", "C18", "C19", "C20", "C21")


def avazu_schema(split_hour: bool = True) -> TabularSchema:
    categorical = tuple(c for c in AVAZU_COLUMNS[2:] if not (split_hour and c == "hour"))
    return TabularSchema(labels=("click",), categorical=categorical,
                         hour_columns=("hour",) if split_hour else (), delimiter=",",
                         header=True, column_names=AVAZU_COLUMNS, binary_labels=True, standardize=False)


class AvazuReader(DelimitedTextReader):
    """Batches of Avazu rows: no dense features, 23 (or 22 with split_hour=False) sparse
    features. Takes the keyword arguments of `DelimitedTextReader`."""

    def __init__(self, paths, batch_size: int, *, split_hour: bool = True, **kwargs) -> None:
        super().__init__(paths, avazu_schema(split_hour), batch_size, **kwargs)
