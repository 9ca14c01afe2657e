"""Model FLOPs of training on a token, and the share of the measured matmul rate they reach (MFU).

[Note: model FLOPs]
A dense layer with n parameters costs 2 n FLOPs per token in the forward (a multiply and an add per
weight), and in the backward 2 n for the gradient of its input plus 2 n for the gradient of its weights.
Training on one token of a model of N parameters, T of them trainable, is so

    flops_per_token = 2 N  +  2 N  +  2 T        (6 N when every parameter trains)

the usual 6 N of a full fine-tune, and 4 N + 2 T for a frozen model with adapters (LoRA), whose frozen
weights need no gradient but pass one on. Left out, as MFU is usually counted: the attention scores
(about 12 L h s FLOPs per token, small beside 6 N at the sequence lengths zerofit fine-tunes at) and a
forward recomputed under activation checkpointing (hardware FLOPs, not model FLOPs); an embedding table is
counted as if it were a matmul (a lookup is not; an untied one's 6 V h per token is an overestimate).
MFU divides the model FLOPs one GPU did in a second by the bf16 matmul rate the planner's probe measured
on it (`bandwidth.Rates.gpu_tflops`, one 4096-cube product), not by a data-sheet peak: the figure says how
far a run is from what this GPU does with one large product.
"""

from __future__ import annotations

FORWARD_FLOPS_PER_PARAM = 2
"""FLOPs per parameter and token of a forward (a multiply and an add)."""


def forward_flops(params: int, tokens: int) -> int:
    """FLOPs of a forward of `params` parameters over `tokens` tokens (what a recomputed forward costs)."""
    return FORWARD_FLOPS_PER_PARAM * params * tokens


def train_flops_per_token(params: int, trainable: int) -> int:
    """Model FLOPs of one training token (forward and backward) of a model of `params` parameters, `trainable`
    of them trained: [Note: model FLOPs]."""
    if trainable > params or trainable < 0:
        raise ValueError(f"trainable parameters must be between 0 and the {params} parameters (got {trainable})")
    return 2 * FORWARD_FLOPS_PER_PARAM * params + FORWARD_FLOPS_PER_PARAM * trainable


def mfu(flops_per_token: float, tokens_per_s: float, peak_tflops: float) -> float:
    """Model FLOPs utilisation of one GPU (0 to 1, more where the probe's rate understates the GPU): the model
    FLOPs of `tokens_per_s` tokens a second on it against its measured bf16 matmul rate, in TFLOP/s."""
    return flops_per_token * tokens_per_s / (peak_tflops * 1e12)
