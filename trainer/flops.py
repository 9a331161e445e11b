"""The arithmetic of one training step: ``moment plan --nodes``'s compute estimate.

The forward pass is each layer's FLOPs as its registered model counts them
(:data:`trainer.models.LAYERS`, ``Layer.flops``; a multiply-add is 2) over the batch's expected
layer sizes, the ones the memory budget uses (:func:`trainer.memory.layer_sizes`: seeds, each
hop's distinct vertices, the sampled edges into them). The backward pass is counted as twice the
forward: a linear map's backward is two matmuls of its forward's size (the gradients of its input
and of its weights), and a gather's is a scatter of the same elements. So a step is 3 × forward,
the rule Kaplan et al. count training compute with ("Scaling Laws for Neural Language Models",
2020: 6N FLOPs per token, the forward's 2N three times). The optimizer step (a few FLOPs per
parameter) is left out: a model of ~10^5-10^6 parameters against ~10^10-10^12 FLOPs a batch.
"""

from __future__ import annotations

from trainer.memory import RunShape, layer_sizes
from trainer.models import flops_of

BACKWARD = 2.0  # backward FLOPs per forward FLOP


def step_flops(shape: RunShape) -> float:
    """FLOPs of one training step (forward and backward) of ``shape``'s model on one batch."""
    flops = flops_of(shape.model)
    return (1.0 + BACKWARD) * sum(flops(size) for size, _ in layer_sizes(shape))
