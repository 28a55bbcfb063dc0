"""Distributed equivalent substitution (DES, Tencent 2019, §3.2 and §4) of a model's weight-rich
first layers: the model-side split.

A supported model computes, from the pooled embeddings of its F fields, a few sums over the
fields before anything non-linear happens:

    LR       logit      = sum_f wide_f w_f                   + dense . u + b
    FM       + 0.5 * ((sum_f v_f)^2 - sum_f v_f^2) . m       (Rendle's linear form, per dimension)
    DNN      h1         = sum_f W1[:, block f] v_f           + W1[:, dense] dense + b1
    W&D      = LR + head(MLP rest(ReLU(h1))),   DeepFM = W&D + the FM term

Each sum over fields splits into one sum per owner of a set of fields (the placement gives each
trainer its fields), so with the fields split among N trainers

    model(deep, wide, dense) == upper(sum over trainers t of partial_t(deep[:, F_t], wide[:, F_t]), dense)

`partial_t` is the trainer's sub-operator: it uses only its fields' embeddings and its block of
the first-layer weights (`first_order`: the rows w_f of its fields; `fc`: the columns of W1 that
multiply its fields' embeddings), and returns one [B, P] tensor, the concatenation of

    [0, T)                the first-order logit partial  sum_{f in F_t} wide_f w_f          (all four)
    [T, T+D)              sum_{f in F_t} v_f                                               (FM, DeepFM)
    [T+D, T+2D)           sum_{f in F_t} v_f * v_f                                         (FM, DeepFM)
    [.., .. + H1)         deep_t.flatten(1) @ W1[:, block F_t].T                           (W&D, DeepFM)

(T tasks, D = embedding_dim, H1 = the first hidden layer's width). `reduce` sums the trainers'
partials (the DES dense sync: one AllReduce); `upper` is everything after the sums, the same on
every trainer: the dense features' terms (their rows of the first-order weight and their columns
of W1, with the biases), the FM combination and the MLP past its first linear map, and the head.

Equivalent up to the order of float additions: the tests hold DES on 2 and 3 trainers to
1-process training after several steps. Parameters keep their identity with the original model's
(`pieces` maps each parameter here to a slice of a parameter of the original), so `full_state`
assembles the whole model's state dict (and its optimizer's) from every owner's part and
`load_full_state` slices one: a DES checkpoint is a 1-process checkpoint.

Not substitutable exactly: DCN's cross network (x0 * (W x + b) multiplies every input element
by a full-width product, so no per-field partial sums combine into it) and DLRM's dot
interaction (<v_f, v_g> for pairs of fields owned by different trainers needs the embeddings
themselves); models without a first hidden layer (hidden: []) feed the embeddings straight into
the task head, whose shape (towers, MMoE gates) varies, so they are refused too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor, nn
from torch.nn import functional as nnf

from hybridrec.models.base import CTRModel
from hybridrec.models.deepfm import DeepFM
from hybridrec.models.fm import FactorizationMachine
from hybridrec.models.lr import LogisticRegression
from hybridrec.models.wide_deep import WideAndDeep

SUPPORTED = ("lr", "fm", "wide_deep", "deepfm")
_CLASSES = (LogisticRegression, FactorizationMachine, WideAndDeep, DeepFM)
WHY_NOT = {
    "dcn": "DCN's cross network multiplies each input element by a full-width product (x0 * (W x + b)), "
           "which no sum of per-field partial results equals",
    "dlrm": "DLRM's dot interaction takes <v_f, v_g> for every pair of fields, and fields on two trainers "
            "would need each other's embeddings",
}


def des_refusal(model_name: str, hparams: dict) -> str | None:
    """Why DES cannot substitute model `model_name` exactly (None: it can)."""
    if model_name not in SUPPORTED:
        reason = WHY_NOT.get(model_name, "no exact substitution of its first layers is known")
        return f"model {model_name!r} cannot be substituted exactly: {reason}. DES supports {list(SUPPORTED)}"
    if model_name in ("wide_deep", "deepfm") and not list(hparams.get("hidden", (256,))):
        return (f"model {model_name!r} with hidden: [] has no first hidden layer to substitute (its embeddings go "
                f"straight into the task head); give model.hparams.hidden at least one layer")
    return None


def _identity(x: Tensor) -> Tensor:
    return x


@dataclass(frozen=True)
class Piece:
    """Where a parameter of the substituted model sits in the original model: `full` (its name
    there), `dim` and `index` (the slice along `dim`; None: the whole parameter). An owned piece
    (`per_field` > 0) is a trainer's block: `per_field` consecutive entries along `dim` for each of
    its fields, so every owner holds another slice; the others are replicated."""

    full: str
    dim: int = 0
    index: tuple[int, ...] | None = None
    per_field: int = 0

    @property
    def owned(self) -> bool:
        return self.per_field > 0

    def index_of(self, fields: Sequence[int]) -> tuple[int, ...] | None:
        """The slice along `dim` that the owner of `fields` holds (replicated: `index`)."""
        if not self.owned:
            return self.index
        return tuple(f * self.per_field + d for f in fields for d in range(self.per_field))


class SubstitutedModel(nn.Module):
    """`model` with its first layers split by fields: this trainer's block for `fields` (indices
    into the model's F sparse features, in the order the placement stacks their embeddings) and
    the replicated rest. `reduce(partial)` sums the trainers' partial results (default: none,
    one owner of every field). forward(deep [B, F_t, D] | None, wide [B, F_t] | None, dense) ->
    logits [B, T], like the model's, when the partials of all fields are summed."""

    def __init__(self, model: CTRModel, fields: Sequence[int], reduce: Callable[[Tensor], Tensor] | None = None):
        super().__init__()
        if type(model) not in _CLASSES:
            raise ValueError(f"DES substitutes {[c.__name__ for c in _CLASSES]}; got {type(model).__name__}")
        fields = [int(f) for f in fields]
        if len(set(fields)) != len(fields) or any(not 0 <= f < model.num_sparse for f in fields):
            raise ValueError(f"fields must be distinct indices in [0, {model.num_sparse}); got {fields}")
        self.fields = fields
        self.reduce = reduce or _identity
        F, D, T, n = model.num_sparse, model.embedding_dim, model.num_tasks, model.num_dense
        self.num_sparse, self.embedding_dim, self.num_tasks, self.num_dense = F, D, T, n
        self.needs_deep, self.needs_wide = model.needs_deep, model.needs_wide
        self.full_shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
        self.pieces: dict[str, Piece] = {}
        dense_rows = tuple(range(F, F + n))

        def sliced(name: str, full: Tensor, full_name: str, dim: int, index=None, per_field: int = 0) -> nn.Parameter:
            piece = self.pieces[name] = Piece(full_name, dim, None if index is None else tuple(index), per_field)
            where = torch.tensor(piece.index_of(fields), dtype=torch.long, device=full.device)
            return nn.Parameter(full.detach().index_select(dim, where).clone())

        linear = model.linear
        self.first_order = sliced("first_order", linear.weight, "linear.weight", 0, per_field=1)  # [F_t, T]
        self.first_order_dense = sliced("first_order_dense", linear.weight, "linear.weight", 0, dense_rows)
        self.first_order_bias = linear.bias
        self.pieces["first_order_bias"] = Piece("linear.bias")
        self.interaction = getattr(model, "interaction", None)  # FM and DeepFM: the [D, T] weight m
        if self.interaction is not None:
            self.pieces["interaction.weight"] = Piece("interaction.weight")
        mlp = getattr(model, "mlp", None)
        self.mlp_rest = self.head = None
        if mlp is not None:
            first = mlp.layers[0]
            self.fc = sliced("fc", first.weight, "mlp.layers.0.weight", 1, per_field=D)  # [H1, F_t*D]
            self.fc_dense = sliced("fc_dense", first.weight, "mlp.layers.0.weight", 1, range(F * D, F * D + n))
            self.fc_bias = first.bias
            self.pieces["fc_bias"] = Piece("mlp.layers.0.bias")
            self.mlp_rest = nn.Sequential(*list(mlp.layers)[1:])
            for name, _ in self.mlp_rest.named_parameters():
                index, rest = name.split(".", 1)
                self.pieces[f"mlp_rest.{name}"] = Piece(f"mlp.layers.{int(index) + 1}.{rest}")
            self.head = model.head
            for name, _ in self.head.named_parameters():
                self.pieces[f"head.{name}"] = Piece(f"head.{name}")
        self.partial_width = T + (2 * D if self.interaction is not None else 0) + (
            self.fc.shape[0] if mlp is not None else 0)
        missing = {n for n, _ in self.named_parameters()} ^ set(self.pieces)
        assert not missing, f"parameters without a place in the original model: {missing}"

    # ------------------------------------------------------------------ the computation
    def partial(self, deep: Tensor | None, wide: Tensor | None) -> Tensor:
        """This trainer's sub-operators on its fields: [B, partial_width]."""
        parts = [wide @ self.first_order]
        if self.interaction is not None:
            parts += [deep.sum(dim=1), deep.square().sum(dim=1)]
        if self.mlp_rest is not None:
            parts.append(nnf.linear(deep.flatten(1), self.fc))
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]

    def upper(self, summed: Tensor, dense: Tensor) -> Tensor:
        """The layers after the sums, from the summed partials [B, P] and the dense features."""
        T, D = self.num_tasks, self.embedding_dim
        logits = torch.addmm(self.first_order_bias, dense, self.first_order_dense) + summed[:, :T]
        at = T
        if self.interaction is not None:
            square_of_sum, sum_of_squares = summed[:, at:at + D], summed[:, at + D:at + 2 * D]
            at += 2 * D
        if self.mlp_rest is not None:
            first = nnf.linear(dense, self.fc_dense, self.fc_bias) + summed[:, at:]
            logits = logits + self.head(self.mlp_rest(first))
        if self.interaction is not None:
            logits = logits + (0.5 * (square_of_sum.square() - sum_of_squares)) @ self.interaction.weight
        return logits

    def forward(self, deep: Tensor | None, wide: Tensor | None, dense: Tensor | None) -> Tensor:
        local = len(self.fields)
        for name, tensor, tail, needed in (("deep", deep, (local, self.embedding_dim), self.interaction is not None
                                            or self.mlp_rest is not None), ("wide", wide, (local,), True)):
            if needed and (tensor is None or tuple(tensor.shape[1:]) != tail):
                raise ValueError(f"`{name}` must have shape [B, {', '.join(map(str, tail))}] (this trainer's "
                                 f"{local} fields); got {None if tensor is None else list(tensor.shape)}")
        if dense is None:
            dense = wide.new_zeros(wide.shape[0], 0)
        return self.upper(self.reduce(self.partial(deep, wide)), dense)

    # ------------------------------------------------------------------ the original model's state
    def own_tensors(self, tensors: dict[str, Tensor] | None = None) -> dict:
        """What `full_state` needs from this trainer: its fields and, per parameter, `tensors`
        (default: the parameters' values), detached on the CPU."""
        values = dict(self.named_parameters()) if tensors is None else tensors
        return {"fields": self.fields, "tensors": {name: value.detach().cpu() for name, value in values.items()}}

    def full_state(self, parts: Sequence[dict]) -> dict[str, Tensor]:
        """The original model's state dict from every trainer's `own_tensors()` (replicated
        parameters from the first part). ValueError when the parts do not cover every field."""
        return _assemble(self.pieces, self.full_shapes, self.num_sparse, parts)

    def load_full_state(self, state: dict[str, Tensor]) -> None:
        """Take this trainer's parameters from the original model's state dict."""
        values = self.slice_full(state)
        with torch.no_grad():
            for name, param in self.named_parameters():
                param.copy_(values[name])

    def slice_full(self, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        """Per parameter here, its slice of the original model's tensors (named as there)."""
        out = {}
        for name, piece in self.pieces.items():
            full = tensors[piece.full]
            index = piece.index_of(self.fields)
            if index is not None:
                full = full.index_select(piece.dim, torch.tensor(index, dtype=torch.long))
            out[name] = full
        return out

    # ------------------------------------------------------------------ optimizer state
    def full_optimizer_state(self, parts: Sequence[dict], param_groups: list) -> dict:
        """The optimizer state dict the original model's optimizer would hold, from every trainer's
        `own_optimizer_state()`: per-element tensors (Adam's moments, Adagrad's sums) are assembled
        like the parameters, scalars (the step) taken from the first part. `param_groups`: this
        optimizer's (one group)."""
        names = list(self.full_shapes)
        keys = sorted({key for part in parts for per in part["tensors"].values() for key in per})
        state: dict[int, dict] = {}
        for key in keys:
            per_key = [{"fields": part["fields"], "tensors": {name: per[key] for name, per in part["tensors"].items()
                                                               if key in per}} for part in parts]
            first = per_key[0]["tensors"]
            if any(value.dim() == 0 for value in first.values()):  # one number per parameter: replicated
                for name, value in first.items():
                    state.setdefault(names.index(self.pieces[name].full), {})[key] = value
                continue
            for name, value in _assemble(self.pieces, self.full_shapes, self.num_sparse,
                                         per_key).items():
                state.setdefault(names.index(name), {})[key] = value
        groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": list(range(len(names)))}
                  for group in param_groups[:1]]
        return {"state": state, "param_groups": groups}

    def own_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        """This trainer's optimizer state per parameter name, for `full_optimizer_state`."""
        params = dict(self.named_parameters())
        by_id = {id(p): n for n, p in params.items()}
        tensors = {by_id[id(p)]: {k: v.detach().cpu() if torch.is_tensor(v) else torch.tensor(v)
                                  for k, v in optimizer.state[p].items() if v is not None}
                   for group in optimizer.param_groups for p in group["params"] if p in optimizer.state}
        return {"fields": self.fields, "tensors": tensors}

    def load_full_optimizer_state(self, optimizer: torch.optim.Optimizer, full: dict) -> None:
        """Load this trainer's slice of an original-model optimizer state dict into `optimizer`
        (which optimizes this module's parameters, in their order)."""
        names = list(self.full_shapes)
        by_key: dict[str, dict[str, Tensor]] = {}
        for index, entries in full["state"].items():
            for key, value in entries.items():
                by_key.setdefault(key, {})[names[int(index)]] = value
        own = [n for n, _ in self.named_parameters()]
        state: dict[int, dict] = {}
        for key, tensors in by_key.items():
            for name in own:
                piece = self.pieces[name]
                value = tensors.get(piece.full)
                if value is None:
                    continue
                index = piece.index_of(self.fields)
                if value.dim() > 0 and index is not None:
                    value = value.index_select(piece.dim, torch.tensor(index, dtype=torch.long))
                state.setdefault(own.index(name), {})[key] = value.clone()  # Adam steps its `step` in place
        groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": list(range(len(own)))}
                  for group in full["param_groups"][:1]]
        optimizer.load_state_dict({"state": state, "param_groups": groups})


def _assemble(pieces: dict[str, Piece], shapes: dict[str, tuple], num_sparse: int,
              parts: Sequence[dict]) -> dict[str, Tensor]:
    out = {name: None for name in shapes}
    covered_fields: list[int] = []
    for rank, part in enumerate(parts):
        covered_fields += list(part["fields"])
        for name, value in part["tensors"].items():
            piece = pieces[name]
            if not piece.owned and rank > 0:
                continue  # replicated: every trainer holds the same values
            index = piece.index_of(part["fields"])
            if index is None:
                out[piece.full] = value.clone()
                continue
            if out[piece.full] is None:
                out[piece.full] = torch.zeros(shapes[piece.full], dtype=value.dtype)
            out[piece.full].index_copy_(piece.dim, torch.tensor(index, dtype=torch.long), value)
    if sorted(covered_fields) != list(range(num_sparse)):
        raise ValueError(f"the trainers' parts hold fields {sorted(covered_fields)}; every one of the "
                         f"{num_sparse} fields exactly once is needed")
    missing = [name for name, value in out.items() if value is None]
    if missing:
        raise ValueError(f"no trainer's part holds {missing}")
    return out
