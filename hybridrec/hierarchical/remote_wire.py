"""The wire of Hierarchical Training's remote layers: how a list of tensors (a unit's inputs, its
output, their gradients) travels in one transport message, compressed by a wire codec (HT §4.2).

A wire codec has a forward half (activations) and a backward half (gradients):
  none   float32 both ways;
  bf16   bfloat16 both ways;
  int8   int8 activations (a float32 scale per 64 values), bf16 gradients: gradients lose too
         much at 8 bits (the paper);
  topk   float32 activations, gradients sparsified to their top-k entries with error feedback:
         each sender keeps, per tensor slot, what it did not send and adds it to the next
         gradient of that slot (the paper's error correction for the bias sparsifying brings).
The bytes each message puts on the wire are counted exactly (hybridrec.comm.compression).
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import torch

from hybridrec.comm.compression import (INT8_BLOCK, WIRE_CODECS, ErrorFeedback, make_codec, packed_arrays,
                                        unpack_arrays)

MAX_SLOTS = 64  # tensors in one message


def wire_codec(name: str, topk_ratio: float = 0.01):
    """(the forward codec, a factory of backward encoders) of wire codec `name`."""
    if name not in WIRE_CODECS:
        raise ValueError(f"wire codec must be one of {sorted(WIRE_CODECS)}, got {name!r}")
    forward, backward = WIRE_CODECS[name]
    forward_codec = make_codec("int8", block_size=INT8_BLOCK) if forward == "int8" else make_codec(forward)
    if backward == "topk":
        make_codec("topk", ratio=topk_ratio)  # checks the ratio now
        return forward_codec, lambda: ErrorFeedback(make_codec("topk", ratio=topk_ratio))
    codec = make_codec(backward)
    return forward_codec, lambda: codec


class GradientSender:
    """Encodes the gradients one sender puts on the wire, per slot (a unit's input or output):
    plain codecs are stateless; top-k keeps a residual per slot, started afresh when the slot's
    shape changes (a short last batch)."""

    def __init__(self, make):
        self.make = make
        self.state: dict[Any, Any] = {}

    def encode(self, slot, grad: torch.Tensor):
        codec = self.state.get(slot)
        if codec is None or (isinstance(codec, ErrorFeedback) and codec.residual is not None
                             and codec.residual.shape != grad.shape):
            codec = self.state[slot] = self.make()
        return codec.encode(grad, "gradients")


def pack_tensors(encode, tensors: Sequence[torch.Tensor | None], prefix: str) -> tuple[dict, dict]:
    """(arrays, meta) of `tensors` (None kept as a hole), each encoded by `encode(i, tensor)`;
    meta["bytes"] is what they put on the wire."""
    arrays, slots, total = {}, [], 0
    for i, tensor in enumerate(tensors):
        if tensor is None:
            slots.append(None)
            continue
        packed = encode(i, tensor)
        some, about = packed_arrays(packed, f"{prefix}{i}")
        arrays.update(some)
        slots.append(about)
        total += packed.nbytes
    return arrays, {"slots": slots, "bytes": total}


def unpack_tensors(arrays: Mapping[str, np.ndarray], meta: Any, prefix: str, codecs: set[str] | None = None,
                   fits=None) -> tuple[list[torch.Tensor | None], int]:
    """(the float32 tensors `pack_tensors` packed, their bytes on the wire); ValueError naming
    what is malformed. Before any is decoded, each must use one of `codecs` (when given) and
    `fits(shape)` must return None (else the reason its shape is refused)."""
    slots = meta.get("slots") if isinstance(meta, dict) else None
    if not isinstance(slots, list) or len(slots) > MAX_SLOTS:
        raise ValueError(f"{prefix}: meta slots must be a list of at most {MAX_SLOTS} entries, got {slots!r:.100}")
    for i, about in enumerate(slots):
        if about is None:
            continue
        codec = about.get("codec") if isinstance(about, dict) else None
        if codecs is not None and codec not in codecs:
            raise ValueError(f"{prefix}{i}: codec {codec!r:.40} is not this job's wire codec {sorted(codecs)}")
        shape = about.get("shape") if isinstance(about, dict) else None
        why = fits(shape) if fits is not None and isinstance(shape, list) else None
        if why is not None:
            raise ValueError(f"{prefix}{i}: shape {shape!r:.100} {why}")
    out, total = [], 0
    for i, about in enumerate(slots):
        if about is None:
            out.append(None)
            continue
        packed = unpack_arrays(arrays, about, f"{prefix}{i}")
        total += packed.nbytes
        out.append(make_codec(packed.codec).decode(packed))
    return out, total
