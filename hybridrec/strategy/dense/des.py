"""The des dense sync (DES, Tencent 2019, Algorithm 1): the model's weight-rich first layers are
replaced by per-trainer sub-operators on the trainer's own fields (hybridrec.des.substitution;
the fields are the field_sharded placement's `fields` service), whose partial results are summed
by one AllReduce per step (hybridrec.des.partial_sums); everything after the sums is
replicated and runs on every trainer on the whole global batch.

Where the batch is split: nowhere. Every trainer reads the whole global batch (the
field_sharded placement), computes its partial results [B, P] for every sample, and after the
AllReduce holds the same sums as every other trainer, so the replicated layers compute the same
logits, the same loss (the mean over the global batch) and the same gradients on every trainer:
their optimizer steps keep them identical with no gradient exchange. Backward sends nothing
either: d loss / d partial_t = d loss / d sum, which every trainer already holds, flows into its
own sub-operators (its block of the first-layer weights and, through the placement's fused
lookup, its own embedding rows). Fully synchronous: N trainers compute what one process computes
on the same global batches, up to the order of float additions.

Wire bytes are counted as a ring AllReduce moves them (exact for the ring; gloo's framing not
included): of a payload of S bytes split into N chunks, trainer r sends 2S minus two chunks,
2(N-1)/N S on average, 2(N-1) S over all trainers. Every byte is counted once, by the trainer
that sends it (the placement's connections report it as `bytes_sent`, as the sharded placement
does), so the loop's `bytes_per_sample` is bytes on the wire per sample. Only training steps
count (an evaluation's AllReduces do not). `facts()` reports them for the result file.

Checkpoints hold the original model's state (and its optimizer's), assembled from every
trainer's block, so a DES checkpoint is a one-process checkpoint (`hybridrec eval` reads it).
"""
from __future__ import annotations

import torch

from hybridrec.des.partial_sums import SumOverTrainers, ring_bytes
from hybridrec.des.substitution import SubstitutedModel
from hybridrec.strategy.dense import DenseSync, dense_optimizer


class DESDense(DenseSync):
    lockstep = True

    def __init__(self, model: torch.nn.Module, cfg, world, services):
        self.share = services.field_map("dense des")  # this trainer's fields, its wire and input counts
        self.world, self.wire = world, self.share.wire
        self.model = self.module = SubstitutedModel(model, self.share.fields, reduce=self._reduce)
        self.optimizer = dense_optimizer(cfg, self.model.parameters())
        self.steps = 0

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        if not self.world.grouped:
            return partial
        if self.model.training and torch.is_grad_enabled():
            payload = partial.numel() * partial.element_size()
            self.wire.sent += ring_bytes(payload, partial.element_size(), self.world.rank, self.world.size)[0]
            self.wire.payload += payload
            self.wire.collectives += 1
        return SumOverTrainers.apply(partial)

    def begin_step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def finish_step(self) -> None:
        self.optimizer.step()
        self.steps += 1

    def state(self) -> dict:
        """The original model's state and optimizer state, from every trainer's block (a
        collective: every trainer calls it)."""
        parts = self.world.gather(self.model.own_tensors())
        optimizer_parts = self.world.gather(self.model.own_optimizer_state(self.optimizer))
        return {"model": self.model.full_state(parts),
                "optimizer": self.model.full_optimizer_state(optimizer_parts,
                                                             self.optimizer.state_dict()["param_groups"])}

    def load(self, state: dict) -> None:
        self.model.load_full_state(state["model"])
        if "optimizer" in state:
            self.model.load_full_optimizer_state(self.optimizer, state["optimizer"])

    def facts(self, world) -> dict:
        """DES's figures of the whole job (a collective): the partial results' width, per training
        step the AllReduce payload, the wire bytes every trainer sent (summed: each byte once) and
        the input bytes the trainers used, and the embedding rows each trainer holds."""
        mine = {"sent": self.wire.sent, "payload": self.wire.payload, "collectives": self.wire.collectives,
                "input": self.share.input_bytes, "input_batches": self.share.input_batches,
                "steps": self.steps, "rows": self.share.rows()}
        every = world.gather(mine)
        steps = max(every[0]["steps"], 1)
        return {"des": {
            "partial_width": self.model.partial_width,
            "allreduces_per_step": every[0]["collectives"] / steps,
            "allreduce_payload_bytes_per_step": every[0]["payload"] / steps,
            "wire_bytes_per_step": sum(e["sent"] for e in every) / steps,
            "input_bytes_per_step": sum(e["input"] for e in every) / max(every[0]["input_batches"], 1),
            "embedding_rows_by_trainer": [e["rows"] for e in every],
        }}


DENSE = DESDense
