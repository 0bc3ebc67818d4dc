"""Do attention weights explain a model? The tests of the chapter on attention as explanation.

A wing beside the attention core (the core never imports it; it imports the core and the task wings):

- :mod:`~attention_core.explain.interventions`: replace a trained model's attention weights (uniform, permuted,
  adversarial) inside its own layers, and measure the output's change (JSD, TVD);
- :mod:`~attention_core.explain.attribution`: attention rollout and flow, gradient x input, integrated
  gradients, leave-one-out, and Spearman's rank correlation to compare them.
"""

from attention_core.explain.attribution import (
    attention_flow,
    attention_rollout,
    gradient_x_input,
    integrated_gradients,
    leave_one_out,
    residual_attention,
    spearman,
)
from attention_core.explain.interventions import (
    AdversarialResult,
    Intervention,
    Recorder,
    adversarial_attention,
    intervene,
    jsd,
    permute_weights,
    tvd,
    uniform_weights,
)

__all__ = [
    "AdversarialResult",
    "Intervention",
    "Recorder",
    "adversarial_attention",
    "attention_flow",
    "attention_rollout",
    "gradient_x_input",
    "integrated_gradients",
    "intervene",
    "jsd",
    "leave_one_out",
    "permute_weights",
    "residual_attention",
    "spearman",
    "tvd",
    "uniform_weights",
]
