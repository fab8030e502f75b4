"""Registers the asynchronous off-policy stage and its importance-sampling losses."""

from tempering.hookspecs import hookimpl

_L = "tempering.algorithms.offpolicy.loss"


@hookimpl
def register_algorithms(register):
    register(
        "offpolicy",
        "tempering.algorithms.offpolicy.algorithm:OffPolicyRL",
        description="async RL: sampling overlaps training, stale rollouts corrected by clipped IS",
    )


@hookimpl
def register_losses(register):
    register("ppo", f"{_L}:PPOLoss", description="-sum min(rho A, clip(rho, 0.8, 1.2) A): Tinker's ppo")
    register("cispo", f"{_L}:CISPOLoss", description="-sum sg(clip(rho, 0, 4)) A lp: Tinker's cispo")
    register("tis", f"{_L}:TISLoss", description="truncated IS -sum sg(min(rho, C)) A lp (Tinker cispo {0, C})")
    register(
        "clipped_is",
        f"{_L}:ClippedISLoss",
        description="stale-rollout recipe: ppo's clip(rho, 0.8, 1.2) on |A| capped at 3x its running mean",
    )
