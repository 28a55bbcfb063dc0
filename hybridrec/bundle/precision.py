"""How a bundle stores a table's weights: fp32 as trained, fp16 (half the bytes), or int8
row-wise (TorchRec's layout: each row's values as 8-bit codes with an fp16 scale and bias of
its own, so a row with large values costs no precision to a row with small ones).

A row of dim 1 has nothing to share a scale with: under int8 its value is kept as fp16 (a
row-wise int8 code of one value would need a scale and a bias larger than the value).
"""
from __future__ import annotations

import numpy as np

PRECISIONS = ("fp32", "fp16", "int8")


def stored_precision(precision: str, dim: int) -> str:
    """The precision a table of `dim` is stored in when the bundle asks for `precision`."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision: {precision!r} is not one of {list(PRECISIONS)}")
    return "fp16" if precision == "int8" and dim == 1 else precision


def quantize(weights: np.ndarray, precision: str) -> dict[str, np.ndarray]:
    """The arrays that store float32 `weights` [n, dim] at `precision` (stored_precision's):
    fp32 {weights}, fp16 {weights: uint16 bits}, int8 {codes: uint8, scale, bias: fp16 bits}."""
    weights = np.ascontiguousarray(weights, dtype=np.float32)
    if precision == "fp32":
        return {"weights": weights}
    if precision == "fp16":
        return {"weights": weights.astype(np.float16).view(np.uint16)}
    if precision != "int8":
        raise ValueError(f"precision: {precision!r} is not one of {list(PRECISIONS)}")
    n = weights.shape[0]
    if n == 0:
        return {"codes": np.empty(weights.shape, np.uint8), "scale": np.empty(0, np.uint16),
                "bias": np.empty(0, np.uint16)}
    low, high = weights.min(axis=1), weights.max(axis=1)
    bias = low.astype(np.float16)
    # the scale is rounded to fp16 before the codes are made, so the codes fit the scale stored
    scale = ((high - bias.astype(np.float32)) / 255.0).astype(np.float16)
    step = scale.astype(np.float32)
    safe = np.where(step > 0, step, 1.0)[:, None]
    codes = np.rint((weights - bias.astype(np.float32)[:, None]) / safe)
    codes = np.where(step[:, None] > 0, np.clip(codes, 0, 255), 0).astype(np.uint8)
    return {"codes": codes, "scale": scale.view(np.uint16), "bias": bias.view(np.uint16)}


def dequantize(arrays: dict[str, np.ndarray], precision: str) -> np.ndarray:
    """float32 [n, dim] from what `quantize` made."""
    if precision == "fp32":
        return arrays["weights"]
    if precision == "fp16":
        return arrays["weights"].view(np.float16).astype(np.float32)
    scale = arrays["scale"].view(np.float16).astype(np.float32)[:, None]
    bias = arrays["bias"].view(np.float16).astype(np.float32)[:, None]
    return arrays["codes"].astype(np.float32) * scale + bias
