"""Self-distillation policy optimization (SDPO, Hübotter et al. 2026): GRPO plus distillation from
the same model re-prompted with a successful sibling's answer or the environment's feedback."""
