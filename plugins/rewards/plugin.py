"""Registers the built-in rewards (lazy ``module:attr`` targets: nothing heavy is imported
until a reward is built)."""

from tempering.hookspecs import hookimpl

_R = "tempering.plugins.rewards"


@hookimpl
def register_rewards(register):
    register("exact_match", f"{_R}.basic:ExactMatch", description="1 if the answer matches exactly")
    register(
        "math_answer",
        f"{_R}.math_answer:MathAnswer",
        description="numeric final answer (\\boxed{} or last number): fractions, decimals, 1,000, %; tolerance",
    )
    register(
        "llm_judge",
        f"{_R}.judge:LLMJudge",
        description="LLM-as-judge, graded (Score: 7/10) or yes/no; OpenAI-compatible HTTP or a sampler object",
    )
    register(
        "brier",
        f"{_R}.forecast:Brier",
        description="-(p - y)^2 for a probability forecast (negated Brier: higher is better)",
    )
    register(
        "brier_skill",
        f"{_R}.forecast:BrierSkill",
        description="1 - Brier/Brier_ref against a base rate p_ref (default 0.5 or an example key)",
    )
    register(
        "retrieval_recall",
        f"{_R}.retrieval:RetrievalRecall",
        description="recall of cited [docN] ids against gold ids, minus coef * length",
    )
    register(
        "answer_match",
        f"{_R}.search:AnswerMatch",
        description="1 if the final answer, citations removed, equals the gold answer",
    )
    register(
        "tool_call_cost",
        f"{_R}.search:ToolCallCost",
        description="-(tool calls of the episode): a cost per call (search environment)",
    )
    register(
        "context_token_cost",
        f"{_R}.search:ContextTokenCost",
        description="-(tokens the model read over the episode): a cost per context token (search environment)",
    )
    register(
        "weighted",
        f"{_R}.combine:weighted",
        description="weighted sum of other rewards by name; fails if any component fails",
    )
    register(
        "process_pool",
        f"{_R}.pool:ProcessPoolReward",
        description="run a CPU-heavy reward in worker processes with a per-call timeout",
    )
    register(
        "remote",
        f"{_R}.remote:RemoteReward",
        description="reward served over HTTP (tempering serve-reward): retries, backoff, batching",
    )
    register(
        "monitor",
        f"{_R}.monitor:MonitorReward",
        description="a monitor reading the CoT predicts the policy's answers on counterfactual prompts: its accuracy",
    )
    register(
        "python",
        f"{_R}.python:python_reward",
        description="your own function or class by import path: {name: python, function: my_module:score}",
    )
    register(
        "sandbox",
        f"{_R}.sandbox.reward:Sandbox",
        description="runs the model's program against the example's asserts in an isolated sandbox (bubblewrap)",
    )
