"""The CTC transformer (pre-LayerNorm, CAPE positions), its presets, loss and greedy decoding."""

from pflbench.model.transformer import (
    PRESETS,
    CTCTransformer,
    ModelConfig,
    build_model,
    count_parameters,
    ctc_loss,
    greedy_decode,
    greedy_ids,
    model_flops_per_frame,
    training_layers,
)

__all__ = [
    "PRESETS",
    "CTCTransformer",
    "ModelConfig",
    "build_model",
    "count_parameters",
    "ctc_loss",
    "greedy_decode",
    "greedy_ids",
    "model_flops_per_frame",
    "training_layers",
]
