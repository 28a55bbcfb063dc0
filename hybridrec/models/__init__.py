"""hybridrec.models: the dense parts of CTR models (they never see IDs).

Every model maps (deep [B, F, D], wide [B, F] or None, dense [B, n_dense]) to logits
[B, num_tasks]; see `hybridrec.models.base` for the contract and `build_model` /
`model_hparams` for construction by name.
"""

from hybridrec.models.base import CTRModel
from hybridrec.models.dcn import DCN, CrossNetwork
from hybridrec.models.deepfm import DeepFM
from hybridrec.models.dlrm import DLRM
from hybridrec.models.fm import FactorizationMachine, PairwiseInteraction
from hybridrec.models.lr import FirstOrderTerm, LogisticRegression
from hybridrec.models.mlp import MLP, GroupedLinear, GroupedMLP
from hybridrec.models.multitask import MULTITASK_KINDS, TaskHead
from hybridrec.models.registry import (HPARAM_HELP, MODELS, HyperParameterError, build_model, describe_models,
                                       model_class, model_hparams)
from hybridrec.models.wide_deep import WideAndDeep

__all__ = [
    "CTRModel",
    "CrossNetwork",
    "DCN",
    "DLRM",
    "DeepFM",
    "FactorizationMachine",
    "FirstOrderTerm",
    "HPARAM_HELP",
    "HyperParameterError",
    "GroupedLinear",
    "GroupedMLP",
    "LogisticRegression",
    "MLP",
    "MODELS",
    "MULTITASK_KINDS",
    "PairwiseInteraction",
    "TaskHead",
    "WideAndDeep",
    "build_model",
    "describe_models",
    "model_class",
    "model_hparams",
]
