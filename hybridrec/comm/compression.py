"""Compression of dense tensors on the wire (Hierarchical Training §4.2): what travels between
trainers and group PSs (activations forward, gradients backward) and in the dense sync.

* bf16: float32 -> bfloat16, rounded to nearest even (torch's cast; `bf16_bits` is the same
  rounding in vectorised numpy for the embedding value codec of hybridrec.comm.codec, which runs
  no torch op). 2 bytes a value; bf16 keeps float32's exponent, so no scale is needed and the
  relative error of each value is at most 2**-8. For activations and gradients.
* int8: per row (the last dimension) or per block of the flattened tensor, scale = absmax / 127
  (one float32 beside the int8 values), values rounded to the nearest step. For forward
  activations only: the absolute error of a value is up to absmax / 254 of its row, so the
  small entries of a row with one large entry lose all their digits. Activations tolerate this
  (the next layer averages over many of them), but gradients span orders of magnitude within a
  row and the paper found them "extremely sensitive to lower bit precision"; they go as bf16.
  `Int8Codec.encode(..., gradient=True)` is refused for that reason.
* top-k sparsification with error feedback (Karimireddy et al. 2019): `ErrorFeedback` is the
  state of one tensor; each step it adds its residual to the new gradient, sends the k
  largest-magnitude entries (indices int32 + values) and keeps everything not sent (including
  what the value format's rounding lost) as the next residual, so over any number of steps
  sum(sent) + residual == sum(true gradients) up to float rounding of the additions.

Each encode returns a `Packed` (named tensors + shape) whose `nbytes` counts exactly the bytes
its tensors put on the wire; decode gives the float32 tensor back. All of it is torch ops over
whole tensors (no Python loop per element).

`wire(x, forward, backward, stats)` passes a tensor through a compressed wire inside autograd
(forward codec on the value, backward codec on its gradient, bytes counted), for measuring a
codec's effect on training in one process (the group PSs of hybridrec.strategy.dense use the
same codecs between processes). `dense_comm_hook(name)` turns a codec into a DDP communication hook for the allreduce dense sync
(bf16: the bucket allreduced as bfloat16; topk: each rank's top-k entries with error feedback
allgathered and averaged), with the bytes each rank sends counted in the hook's state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

DENSE_CODECS = ("none", "bf16", "topk")
# the wire between HT's trainers and group PSs: codec -> (activations forward, gradients backward)
WIRE_CODECS = {"none": ("none", "none"), "bf16": ("bf16", "bf16"), "int8": ("int8", "bf16"), "topk": ("none", "topk")}
INT8_BLOCK = 64  # activations per int8 scale on that wire: narrow activations need no scale a row
INT8_MAX = 127.0


# ------------------------------------------------------------------------------------ bf16 (numpy)
def bf16_bits(values: np.ndarray) -> np.ndarray:
    """The bfloat16 bit patterns (uint16) of float32 `values`, rounded to nearest even, as
    torch's float32 -> bfloat16 cast does; NaN stays a (quiet) NaN, values past bf16's largest
    finite value round to inf."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    bits = values.view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
    nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    if nan.any():
        rounded = np.where(nan, (bits >> np.uint32(16)) | np.uint32(0x0040), rounded)
    return rounded.astype(np.uint16)


def bf16_floats(bits: np.ndarray) -> np.ndarray:
    """float32 values of bfloat16 bit patterns (exact)."""
    bits = np.ascontiguousarray(bits, dtype=np.uint16)
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


# ------------------------------------------------------------------------------------ packed tensors
@dataclass(frozen=True)
class Packed:
    """What one compressed tensor puts on the wire: named tensors, the original shape and dtype."""

    codec: str
    tensors: dict[str, Tensor]
    shape: tuple[int, ...]
    meta: dict = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Payload bytes on the wire: every tensor's elements times their size."""
        return int(sum(t.numel() * t.element_size() for t in self.tensors.values()))


def _float_tensor(x: Tensor, argument: str) -> Tensor:
    if not isinstance(x, Tensor) or not x.is_floating_point():
        raise TypeError(f"{argument} must be a floating-point torch.Tensor, got "
                        f"{x.dtype if isinstance(x, Tensor) else type(x).__name__}")
    return x.detach().to(torch.float32)


def _expect(packed: Packed, name: str) -> None:
    if not isinstance(packed, Packed) or packed.codec != name:
        raise ValueError(f"this codec decodes {name!r}, got "
                         f"{packed.codec if isinstance(packed, Packed) else type(packed).__name__!r}")


def raw_bytes(x: Tensor) -> int:
    """The bytes `x` takes as float32: the baseline every codec's nbytes is compared with."""
    return x.numel() * 4


class NoCodec:
    """float32 as it is."""

    name = "none"

    def encode(self, x: Tensor, argument: str = "tensor") -> Packed:
        return Packed(self.name, {"values": _float_tensor(x, argument).contiguous()}, tuple(x.shape))

    def decode(self, packed: Packed) -> Tensor:
        _expect(packed, self.name)
        return packed.tensors["values"].reshape(packed.shape)


class Bf16Codec:
    """bfloat16, rounded to nearest even: 2 bytes a value, relative error <= 2**-8."""

    name = "bf16"

    def encode(self, x: Tensor, argument: str = "tensor") -> Packed:
        return Packed(self.name, {"values": _float_tensor(x, argument).to(torch.bfloat16).contiguous()},
                      tuple(x.shape))

    def decode(self, packed: Packed) -> Tensor:
        _expect(packed, self.name)
        return packed.tensors["values"].to(torch.float32).reshape(packed.shape)


class Int8Codec:
    """int8 with absmax scaling per row (`block_size=None`: the last dimension) or per block of
    `block_size` consecutive values of the flattened tensor (the last block zero-padded). For
    forward activations only (see the module docstring): each value is within absmax / 254 of
    its row or block."""

    name = "int8"

    def __init__(self, block_size: int | None = None):
        if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int)
                                       or block_size < 1):
            raise ValueError(f"block_size must be a positive int or None (per row), got {block_size!r}")
        self.block_size = block_size

    def encode(self, x: Tensor, argument: str = "activations", gradient: bool = False) -> Packed:
        if gradient:
            raise ValueError(f"{argument}: int8 is for forward activations only; gradients lose too much at 8 "
                             "bits (HT §4.2), send them as bf16")
        values = _float_tensor(x, argument)
        if not bool(torch.isfinite(values).all()):
            raise ValueError(f"{argument} holds NaN/inf values; int8 encoding needs finite values")
        if self.block_size is None:
            blocks = values.reshape(-1, values.shape[-1] if values.dim() else 1)
        else:
            flat = values.reshape(-1)
            padded = -(-flat.numel() // self.block_size) * self.block_size
            blocks = torch.nn.functional.pad(flat, (0, padded - flat.numel())).reshape(-1, self.block_size)
        scales = blocks.abs().amax(dim=1) / INT8_MAX
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        quantized = torch.round(blocks / safe[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
        return Packed(self.name, {"values": quantized, "scales": scales}, tuple(x.shape))

    def decode(self, packed: Packed) -> Tensor:
        _expect(packed, self.name)
        blocks = packed.tensors["values"].to(torch.float32) * packed.tensors["scales"][:, None]
        return blocks.reshape(-1)[:math.prod(packed.shape)].reshape(packed.shape)


class TopKCodec:
    """The k = max(1, ceil(ratio * n)) largest-magnitude entries of a tensor: int32 indices
    (int64 past 2**31 entries) and their values (float32, or bf16 with `values="bf16"`). Biased
    on its own; use it through `ErrorFeedback`."""

    name = "topk"

    def __init__(self, ratio: float = 0.01, values: str = "float32"):
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
            raise ValueError(f"topk ratio must be a number in (0, 1], got {ratio!r}")
        if values not in ("float32", "bf16"):
            raise ValueError(f"topk values must be 'float32' or 'bf16', got {values!r}")
        self.ratio = float(ratio)
        self.values = torch.float32 if values == "float32" else torch.bfloat16

    def k(self, numel: int) -> int:
        return min(numel, max(1, math.ceil(self.ratio * numel)))

    def encode(self, x: Tensor, argument: str = "gradient") -> Packed:
        flat = _float_tensor(x, argument).reshape(-1)
        index_dtype = torch.int32 if flat.numel() < 2**31 else torch.int64
        if flat.numel() == 0:
            return Packed(self.name, {"indices": torch.empty(0, dtype=index_dtype),
                                      "values": torch.empty(0, dtype=self.values)}, tuple(x.shape))
        indices = torch.topk(flat.abs(), self.k(flat.numel()), sorted=False).indices
        return Packed(self.name, {"indices": indices.to(index_dtype), "values": flat[indices].to(self.values)},
                      tuple(x.shape))

    def decode(self, packed: Packed) -> Tensor:
        _expect(packed, self.name)
        out = torch.zeros(math.prod(packed.shape), dtype=torch.float32)
        out[packed.tensors["indices"].long()] = packed.tensors["values"].to(torch.float32)
        return out.reshape(packed.shape)


class ErrorFeedback:
    """Error-feedback state of ONE tensor (a parameter's gradient, a DDP bucket): `encode(grad)`
    compresses grad + residual with `codec` and keeps as the new residual whatever the decoded
    message lacks, so that sum(decoded messages) + residual == sum(grads) (up to float
    rounding of grad + residual)."""

    def __init__(self, codec: TopKCodec | Bf16Codec | NoCodec):
        self.codec = codec
        self.residual: Tensor | None = None
        self.steps = 0

    def encode(self, grad: Tensor, argument: str = "gradient") -> Packed:
        accumulated = _float_tensor(grad, argument)
        if self.residual is not None:
            if self.residual.shape != accumulated.shape:
                raise ValueError(f"{argument} has shape {tuple(accumulated.shape)}, but this error-feedback state "
                                 f"holds a residual of shape {tuple(self.residual.shape)}: one state per tensor")
            accumulated = accumulated + self.residual
        packed = self.codec.encode(accumulated, argument)
        self.residual = accumulated - self.codec.decode(packed)
        self.steps += 1
        return packed

    def decode(self, packed: Packed) -> Tensor:
        return self.codec.decode(packed)


CODECS = {c.name: c for c in (NoCodec, Bf16Codec, Int8Codec, TopKCodec)}
MAX_WIRE_RANK = 8


# ------------------------------------------------------------------------------------ packed tensors in messages
def packed_arrays(packed: Packed, prefix: str) -> tuple[dict[str, np.ndarray], dict]:
    """The transport arrays (hybridrec.comm.transport) that carry `packed`, each tensor as
    `prefix.name` (a bfloat16 tensor as its int16 bits: numpy has no bfloat16), and the header
    entry `unpack_arrays` needs to rebuild it."""
    arrays, bf16 = {}, []
    for name, tensor in packed.tensors.items():
        if tensor.dtype == torch.bfloat16:
            tensor = tensor.view(torch.int16)
            bf16.append(name)
        arrays[f"{prefix}.{name}"] = tensor.contiguous().numpy()
    return arrays, {"codec": packed.codec, "shape": list(packed.shape), "bf16": bf16}


def unpack_arrays(arrays: dict[str, np.ndarray], about: dict, prefix: str) -> Packed:
    """The Packed that `packed_arrays` sent under `prefix`; ValueError naming what is malformed."""
    if not isinstance(about, dict) or about.get("codec") not in CODECS:
        raise ValueError(f"{prefix}: the packed tensor's header must name a codec of {sorted(CODECS)}, "
                         f"got {about!r:.100}")
    shape, bf16 = about.get("shape"), about.get("bf16", [])
    if (not isinstance(shape, list) or len(shape) > MAX_WIRE_RANK
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)):
        raise ValueError(f"{prefix}: shape must be a list of at most {MAX_WIRE_RANK} ints >= 0, got {shape!r:.100}")
    if not isinstance(bf16, list):
        raise ValueError(f"{prefix}: bf16 must be a list of tensor names, got {bf16!r:.100}")
    tensors = {}
    for key, array in arrays.items():
        if key.startswith(prefix + "."):
            name = key[len(prefix) + 1:]
            tensor = torch.from_numpy(np.array(array))  # the frame is read-only; torch wants its own
            tensors[name] = tensor.view(torch.bfloat16) if name in bf16 else tensor
    packed = Packed(about["codec"], tensors, tuple(shape))
    _check_sizes(packed, prefix)
    return packed


def _check_sizes(packed: Packed, prefix: str) -> None:
    """ValueError when a packed tensor's parts cannot decode to its shape (a malformed message)."""
    numel, t = math.prod(packed.shape), packed.tensors
    needs = {"none": ("values",), "bf16": ("values",), "int8": ("values", "scales"),
             "topk": ("indices", "values")}[packed.codec]
    if sorted(t) != sorted(needs):
        raise ValueError(f"{prefix}: a {packed.codec} tensor carries {list(needs)}, got {sorted(t)}")
    if packed.codec in ("none", "bf16"):
        ok = t["values"].numel() == numel and t["values"].is_floating_point()
    elif packed.codec == "int8":
        values, scales = t["values"], t["scales"]
        ok = (values.dtype == torch.int8 and values.dim() == 2 and scales.dtype == torch.float32
              and scales.shape == values.shape[:1] and values.numel() >= numel)
    else:
        indices = t["indices"]
        ok = (indices.dtype in (torch.int32, torch.int64) and indices.shape == t["values"].shape
              and (indices.numel() == 0 or (int(indices.min()) >= 0 and int(indices.max()) < numel)))
    if not ok:
        raise ValueError(f"{prefix}: the {packed.codec} tensor's parts do not make shape {list(packed.shape)}")


def make_codec(name: str, **options) -> NoCodec | Bf16Codec | Int8Codec | TopKCodec:
    """The tensor codec called `name` (none, bf16, int8, topk)."""
    if name not in CODECS:
        raise ValueError(f"compression codec must be one of {sorted(CODECS)}, got {name!r}")
    return CODECS[name](**options)


# ------------------------------------------------------------------------------------ a wire in autograd
@dataclass
class WireStats:
    """Bytes that `wire` put on the wire: forward (activations), backward (gradients), and what
    float32 would have sent both ways."""

    forward_bytes: int = 0
    backward_bytes: int = 0
    raw_bytes: int = 0
    crossings: int = 0


class _Wire(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, forward_codec, backward_codec, stats):
        ctx.backward_codec, ctx.stats = backward_codec, stats
        packed = forward_codec.encode(x, "activations")
        if stats is not None:
            stats.forward_bytes += packed.nbytes
            stats.raw_bytes += raw_bytes(x)
            stats.crossings += 1
        return forward_codec.decode(packed).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        packed = ctx.backward_codec.encode(grad, "gradients")
        if ctx.stats is not None:
            ctx.stats.backward_bytes += packed.nbytes
            ctx.stats.raw_bytes += raw_bytes(grad)
        return ctx.backward_codec.decode(packed).to(grad.dtype), None, None, None


WIRE_FORWARD = ("none", "bf16", "int8")
WIRE_BACKWARD = ("none", "bf16")


def wire(x: Tensor, forward: str = "none", backward: str = "none", stats: WireStats | None = None) -> Tensor:
    """`x` as the far side of a wire sees it: the forward value encoded with codec `forward`
    (none | bf16 | int8) and decoded, its gradient encoded with `backward` (none | bf16) on the way
    back; the bytes both ways are added to `stats`: the numerics and byte counts of a compressed
    wire in one process. int8 is not offered for gradients (see the module docstring)."""
    if forward not in WIRE_FORWARD:
        raise ValueError(f"wire forward codec must be one of {list(WIRE_FORWARD)}, got {forward!r}")
    if backward not in WIRE_BACKWARD:
        raise ValueError(f"wire backward codec must be one of {list(WIRE_BACKWARD)} (gradients lose too much "
                         f"at 8 bits), got {backward!r}")
    return _Wire.apply(x, make_codec(forward), make_codec(backward), stats)


# ------------------------------------------------------------------------------------ DDP hooks
@dataclass
class HookState:
    """What a dense communication hook keeps between steps: the process group, the error-feedback
    state of each bucket (topk), and byte counts: `bytes_sent` is what this rank put on the wire
    for the gradients, `raw_bytes` what float32 allreduce would have sent."""

    process_group: object = None
    ratio: float = 0.01
    feedback: dict[int, ErrorFeedback] = field(default_factory=dict)
    bytes_sent: int = 0
    raw_bytes: int = 0
    calls: int = 0  # buckets communicated
    steps: int = 0  # steps whose last bucket was communicated

    def residual_of(self, bucket_index: int) -> Tensor | None:
        state = self.feedback.get(bucket_index)
        return None if state is None else state.residual


def _group(state: HookState):
    import torch.distributed as dist

    return state.process_group if state.process_group is not None else dist.group.WORLD


def _bf16_hook(state: HookState, bucket):
    """Allreduce of the bucket as bfloat16 (each rank's share divided by the world size first)."""
    import torch.distributed as dist

    group = _group(state)
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(dist.get_world_size(group))
    state.bytes_sent += compressed.numel() * compressed.element_size()
    state.raw_bytes += buffer.numel() * 4
    state.calls += 1
    state.steps += int(bucket.is_last())

    def decompress(fut):
        buffer.copy_(fut.value()[0])
        return buffer

    return dist.all_reduce(compressed, group=group, async_op=True).get_future().then(decompress)


def _topk_hook(state: HookState, bucket):
    """Each rank's top-k of (bucket + its residual), as one int32 tensor [indices | value bits],
    allgathered; every rank scatters all ranks' entries into the bucket and averages. The first
    step (while DDP may still rebuild its buckets) is a plain allreduce."""
    import torch.distributed as dist

    group = _group(state)
    world = dist.get_world_size(group)
    buffer = bucket.buffer()
    state.raw_bytes += buffer.numel() * 4
    first_step = state.steps == 0
    state.calls += 1
    state.steps += int(bucket.is_last())
    if first_step or buffer.dtype != torch.float32 or buffer.numel() >= 2**31:
        state.bytes_sent += buffer.numel() * buffer.element_size()
        div = buffer.div_(world)
        return dist.all_reduce(div, group=group, async_op=True).get_future().then(lambda fut: fut.value()[0])
    feedback = state.feedback.setdefault(bucket.index(), ErrorFeedback(TopKCodec(state.ratio)))
    packed = feedback.encode(buffer, "gradient bucket")
    message = torch.cat([packed.tensors["indices"], packed.tensors["values"].view(torch.int32)])
    state.bytes_sent += packed.nbytes
    gathered = [torch.empty_like(message) for _ in range(world)]

    def combine(fut):
        everything = torch.stack(gathered)
        k = message.numel() // 2
        indices = everything[:, :k].reshape(-1).long()
        values = everything[:, k:].contiguous().view(torch.float32).reshape(-1)
        buffer.zero_()
        buffer.index_add_(0, indices, values)
        return buffer.div_(world)

    return dist.all_gather(gathered, message, group=group, async_op=True).get_future().then(combine)


@dataclass
class DenseCommHook:
    """A DDP communication hook and its state: `register(ddp_model)` installs it; `state` holds
    the byte counts and error-feedback residuals."""

    name: str
    state: HookState
    hook: object

    def register(self, ddp_model) -> None:
        ddp_model.register_comm_hook(self.state, self.hook)


def dense_comm_hook(name: str, topk_ratio: float = 0.01, process_group=None) -> DenseCommHook | None:
    """The DDP communication hook of dense codec `name`: None for "none" (DDP's own float32
    allreduce), bf16, or topk (error feedback, `topk_ratio` of each bucket's entries per step)."""
    if name not in DENSE_CODECS:
        raise ValueError(f"dense_codec must be one of {list(DENSE_CODECS)}, got {name!r}")
    if name == "none":
        return None
    TopKCodec(topk_ratio)  # checks the ratio
    state = HookState(process_group=process_group, ratio=float(topk_ratio))
    return DenseCommHook(name, state, _bf16_hook if name == "bf16" else _topk_hook)
