"""An inspect_ai model provider: evaluate a tempering run or exported model with any inspect task.

::

    pip install 'tempering[inspect]'
    inspect eval my_task.py --model tempering/runs/arithmetic            # the run's latest checkpoint
    inspect eval my_task.py --model tempering/runs/arithmetic -M step=120
    inspect eval my_task.py --model tempering/exports/arithmetic         # an exported model folder

inspect finds the provider through tempering's ``inspect_ai`` entry point. The model name is a
run folder (its backend rebuilt from ``run.json`` with a checkpoint loaded, as
``tempering eval`` does) or a Hugging Face model folder. Generation goes through tempering's
``completion`` sampler, so an inspect task sees exactly what training sampled: chat messages
rendered by the model's renderer (``-M renderer=...``, default ``auto``) and parsed back, or --
for a model without a chat format (``-M chat=false``, the default when its tokenizer has no
renderer hint and no chat template) -- the last user message as a plain text prompt. inspect's
``max_tokens`` (default 32), ``temperature`` (default 0: greedy), ``top_p`` and ``seed`` apply.
"""

from __future__ import annotations

import os
from contextlib import ExitStack
from functools import lru_cache
from typing import Any

from tempering.types import SamplingParams

DEFAULT_MAX_TOKENS = 32


@lru_cache(maxsize=1)
def model_class() -> type:
    """The inspect ``ModelAPI`` class, defined on first use: inspect_ai is an optional extra, so
    this module imports (and is inert) without it."""
    from inspect_ai.model import ChatMessage, GenerateConfig, ModelAPI, ModelOutput
    from inspect_ai.tool import ToolChoice, ToolInfo

    class TemperingModel(ModelAPI):
        """``tempering/<run folder or model folder>`` (see the module docs)."""

        def __init__(
            self,
            model_name: str,
            base_url: str | None = None,
            api_key: str | None = None,
            config: GenerateConfig | None = None,
            step: int | None = None,
            renderer: str = "auto",
            chat: bool | None = None,
            **model_args: object,
        ) -> None:
            # on first use: inspect imports this entry point on every start, the runner stays unloaded
            from tempering.apps.export import exported_renderer
            from tempering.interfaces import model_renderer
            from tempering.registry import get_registry
            from tempering.rollouts.renderer import RAW
            from tempering.training.evaluate import completion_sampler
            from tempering.training.rundata import RunDir, run_backend

            super().__init__(model_name, base_url, api_key, [], config or GenerateConfig())
            if model_args:
                raise ValueError(
                    f"tempering model: unknown -M arguments {sorted(model_args)}; known: step, renderer, chat"
                )
            self._stack = ExitStack()
            registry = get_registry()
            hint = None
            if os.path.isfile(os.path.join(model_name, "config.json")):
                self.backend = registry.build("backend", {"name": "local", "model": model_name}, "backend")
                self._stack.callback(self.backend.close)
                hint = exported_renderer(model_name)
            else:
                self.backend, _ = self._stack.enter_context(
                    run_backend(RunDir.open(model_name, "model"), step, registry)
                )
            tokenizer = self.backend.tokenizer
            hint = hint or model_renderer(self.backend)
            self.chat = bool(hint or getattr(tokenizer, "chat_template", None)) if chat is None else bool(chat)
            spec = hint if renderer == "auto" and hint else renderer
            # chat off: the last user text goes raw, whatever the model's format
            self.sampler = completion_sampler(tokenizer, hint, None, spec if self.chat else RAW)

        def example(self, messages: list[ChatMessage]) -> dict[str, Any]:
            """The sampler's example: OpenAI-format messages, or the last user text as a prompt."""
            if self.chat:
                return {"messages": [{"role": m.role, "content": m.text} for m in messages]}
            users = [m.text for m in messages if m.role == "user"]
            return {"prompt": users[-1] if users else ""}

        async def generate(
            self, input: list[ChatMessage], tools: list[ToolInfo], tool_choice: ToolChoice, config: GenerateConfig
        ) -> ModelOutput:
            params = SamplingParams(
                max_tokens=config.max_tokens or DEFAULT_MAX_TOKENS,
                temperature=config.temperature if config.temperature is not None else 0.0,
                top_p=config.top_p if config.top_p is not None else 1.0,
                seed=config.seed,
            )
            rollout = await self.sampler.sample(self.backend, [self.example(input)], 1, params)
            completion = rollout.groups[0].samples[0].completion
            stop = "stop" if completion.stop_reason == "stop" else "max_tokens"
            return ModelOutput.from_content(model=self.model_name, content=completion.text, stop_reason=stop)

        def max_connections(self) -> int:
            return 1  # one local model: requests queue on its worker thread anyway

        def close(self) -> None:
            self._stack.close()

    return TemperingModel


try:
    from inspect_ai.model import modelapi
except ImportError:  # without the extra: nothing to register with
    pass
else:
    modelapi(name="tempering")(model_class)
