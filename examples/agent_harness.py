"""Train an agent harness written against the plain ``openai`` SDK (docs/agents.md, section 2).

``run`` below is an ordinary agent loop -- it does not know tempering: it asks a model for the
product of two numbers, offers a ``mul`` tool, runs the tool calls it gets back and scores the
final answer. Pointed at the policy's endpoint by the ``agent`` sampler, every call it makes is
recorded token for token and trained with GRPO.

    pip install 'tempering[openai]'
    tempering run examples/agent_harness.yaml       # the recipe names agent_harness:run
    python examples/agent_harness.py                # the same, from Python (2 steps, tiny model)

The YAML form resolves ``agent_harness:run`` with the working folder on ``sys.path``: run it from
examples/, or put the module where Python finds it (``PYTHONPATH=examples``).
"""

from __future__ import annotations

import json
from typing import Any

import openai

MUL = {
    "type": "function",
    "function": {
        "name": "mul",
        "description": "Multiply two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


async def run(client: openai.AsyncOpenAI, example: dict[str, Any]) -> float:
    """One episode: at most three model calls; 1.0 for the exact product, else 0.0."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": example["question"]}]
    for _ in range(3):
        try:
            out = await client.chat.completions.create(model="policy", messages=messages, tools=[MUL])
        except openai.BadRequestError:  # e.g. past the context budget (max_total_tokens)
            return 0.0
        message = out.choices[0].message
        if not message.tool_calls:
            return float((message.content or "").strip() == example["answer"])
        messages.append(
            {
                "role": "assistant",
                "content": message.content or "",
                "tool_calls": [call.model_dump() for call in message.tool_calls],
            }
        )
        for call in message.tool_calls:
            try:
                args = json.loads(call.function.arguments)
                result = str(int(args["a"]) * int(args["b"]))
            except (KeyError, TypeError, ValueError) as exc:
                result = f"Error: {type(exc).__name__}: {exc}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return 0.0


def main() -> None:
    from tempering.training.recipe import Recipe

    recipe = Recipe.from_yaml(
        __file__.replace(".py", ".yaml"), ["stages.0.steps=2", "output_dir=runs/agent_harness_demo"]
    )
    recipe.stages[0]["sampler"]["harness"] = run  # from Python, the function itself
    print(recipe.run().report())  # where the run went, and what its stage ended with


if __name__ == "__main__":
    main()
