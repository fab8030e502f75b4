"""An OpenEnv server's environment trained through tempering's ``openenv`` environment.

    pip install 'tempering[openenv]'
    python examples/openenv_guess.py serve --port 8011      # the server alone (for `tempering run`)
    python examples/openenv_guess.py run                     # serve on a free port and train against it

The server is openenv-core's own (``create_app``) around a small number-guessing environment:
a typed action ``{"guess": int}``, an observation with a ``hint`` (higher / lower / right),
reward 1 on the right number, done after 3 tries. ``run`` trains a tiny chat model (built in
code) for a few ``grpo`` steps with::

    sampler: {name: environment, max_turns: 3,
              environment: {name: openenv, url: "http://127.0.0.1:PORT", reset_keys: [target],
                            observation_field: hint}}

-- the action offered to the model as a tool ``act(guess=...)``, each call one ``step``. A random
tiny model does not learn the game in a few steps; this shows the wiring (docs/agents.md,
section 4). Put a real model (``backend.model: smollm2``, ``renderer: hf_chat``) and more steps
for a run that learns.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import threading
import time
from typing import Any


def make_app() -> Any:
    from openenv.core.env_server.http_server import create_app
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action, Observation, State
    from pydantic import Field

    class GuessAction(Action):
        """Guess the hidden number."""

        guess: int = Field(..., description="your guess, 1 to 9")

    class GuessObservation(Observation):
        hint: str = Field(default="", description="higher, lower or right")

    class Guess(Environment):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self) -> None:
            super().__init__()
            self.target, self.tries = 5, 0

        def reset(
            self, seed: int | None = None, episode_id: str | None = None, target: int = 5, **kwargs: Any
        ) -> GuessObservation:
            self.target, self.tries = int(target), 0
            return GuessObservation(hint="guess a number from 1 to 9")

        def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:  # type: ignore[override]
            self.tries += 1
            if action.guess == self.target:
                return GuessObservation(hint="right", reward=1.0, done=True)
            hint = "higher" if action.guess < self.target else "lower"
            return GuessObservation(hint=hint, reward=0.0, done=self.tries >= 3)

        @property
        def state(self) -> State:
            return State(step_count=self.tries)

    return create_app(Guess, GuessAction, GuessObservation, env_name="guess", max_concurrent_envs=64)


def serve(port: int, background: bool = False) -> Any:
    """Serve the app on 127.0.0.1:``port`` (in a daemon thread with ``background``)."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(make_app(), host="127.0.0.1", port=port, log_level="warning"))
    if not background:
        server.run()
        return server
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the OpenEnv server did not start on port {port} within 30 s")
        time.sleep(0.05)
    return server


def train(url: str, out: str, steps: int) -> dict[str, Any]:
    from tempering.training.recipe import Recipe

    data = os.path.join(out, "games.jsonl")
    os.makedirs(out, exist_ok=True)
    with open(data, "w") as f:
        f.writelines(json.dumps({"prompt": "find the number", "target": 1 + i % 9}) + "\n" for i in range(64))
    recipe = Recipe.from_dict(
        {
            "name": "openenv_guess",
            "seed": 0,
            "output_dir": os.path.join(out, "run"),
            "loggers": ["jsonl"],
            "backend": {
                "name": "local",
                "model": "tiny_llama",
                "num_threads": 1,
                "model_kwargs": {"chat": True, "max_position_embeddings": 256},
            },
            "stages": [
                {
                    "id": "rl",
                    "name": "grpo",
                    "renderer": "tiny_chat",
                    "steps": steps,
                    "prompts_per_step": 4,
                    "group_size": 4,
                    "max_tokens": 16,
                    "dataset": {"name": "jsonl", "path": data},
                    "sampler": {
                        "name": "environment",
                        "max_turns": 3,
                        "environment": {
                            "name": "openenv",
                            "url": url,
                            "reset_keys": ["target"],
                            "observation_field": "hint",
                        },
                    },
                }
            ],
        }
    )
    return dict(recipe.run().stages["rl"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["serve", "run"])
    parser.add_argument("--port", type=int, default=0, help="serve: the port (run: 0 = a free one)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=None)
    a = parser.parse_args()
    if a.command == "serve":
        serve(a.port or 8011)
        return
    port = a.port
    if not port:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    server = serve(port, background=True)
    try:
        metrics = train(f"http://127.0.0.1:{port}", a.out or tempfile.mkdtemp(prefix="openenv_guess_"), a.steps)
        print({k: v for k, v in metrics.items() if k.startswith(("reward/", "env/"))})
    finally:
        server.should_exit = True


if __name__ == "__main__":
    main()
