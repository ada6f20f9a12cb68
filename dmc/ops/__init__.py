"""Device-agnostic DMC math (no megatron import). Shapes are ``[batch, heads, seq, dim]``."""
from dmc.ops.accumulate import partial_accumulate
from dmc.ops.attention import dmc_attention
from dmc.ops.decisions import (
    DecisionChannels,
    DMSChannels,
    dms_alpha_logit,
    dms_query_heads,
    gumbel_sigmoid,
    importance,
    log_one_minus_gumbel_sigmoid,
    logistic_noise,
    scale_decision_channel,
    split_decision_channels,
    split_dms_channels,
    straight_through_round,
    zero_decision_channel,
    zero_dms_channel,
)
from dmc.ops.loss import (
    PRIORS,
    CRSchedule,
    compression_loss,
    compression_loss_from_sums,
    head_balance_loss,
    head_cap_loss_from_sums,
)
from dmc.ops.mask import (
    bias_from_log_keep,
    dmc_attention_bias,
    dms_attention_bias,
    log_keep_next,
    log_keep_next_from_logits,
)

__all__ = [
    "CRSchedule",
    "PRIORS",
    "DecisionChannels",
    "DMSChannels",
    "bias_from_log_keep",
    "compression_loss",
    "dmc_attention",
    "compression_loss_from_sums",
    "head_balance_loss",
    "head_cap_loss_from_sums",
    "dmc_attention_bias",
    "dms_alpha_logit",
    "dms_attention_bias",
    "dms_query_heads",
    "gumbel_sigmoid",
    "importance",
    "log_keep_next",
    "log_keep_next_from_logits",
    "log_one_minus_gumbel_sigmoid",
    "logistic_noise",
    "partial_accumulate",
    "scale_decision_channel",
    "split_decision_channels",
    "split_dms_channels",
    "straight_through_round",
    "zero_decision_channel",
    "zero_dms_channel",
]
