"""Registers GRPO, its loss and the advantage estimators."""

from tempering.hookspecs import hookimpl

_ADV = "tempering.rlmath.advantages"  # shared by every RL stage; registered here


@hookimpl
def register_algorithms(register):
    register(
        "grpo", "tempering.algorithms.grpo.algorithm:GRPO", description="group-relative RL with verifiable rewards"
    )


@hookimpl
def register_losses(register):
    register(
        "grpo",
        "tempering.algorithms.grpo.loss:GRPOLoss",
        description="clipped PG; grpo/dapo/dr_grpo/bnpo aggregation, k3 KL",
    )


@hookimpl
def register_advantages(register):
    register(
        "group_norm", f"{_ADV}:GroupNormAdvantage", description="(r - group mean) / (std + eps); scale group|batch|none"
    )
    register("dr_grpo", f"{_ADV}:MeanOnlyAdvantage", description="r - group mean (Dr. GRPO, no std)")
    register("rloo", f"{_ADV}:RLOOAdvantage", description="r - mean of the other group members (RLOO)")
