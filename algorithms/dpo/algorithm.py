"""DPO stage: preference pairs -> one optimizer step per batch of pairs.

Reference policy (``reference`` x ``reference_model``):

* ``reference: live`` (default) scores each batch with the reference at every step;
  ``precomputed`` scores the whole dataset once at stage start (one forward per row, no
  reference forward during training), caches it in ``<output_dir>/dpo/<stage>_reference.json``
  and reloads that cache when the stage resumes mid-way.
* ``reference_model: stage_start`` (default) is the policy as it was when this stage began: a
  weight snapshot (saved in checkpoints) with ``live``, the policy's own scores at the start with
  ``precomputed``. That is TRL's reference -- the model handed to the trainer -- translated to
  staged recipes: after an SFT stage it is the SFT model. ``base`` is the backend's reference
  instead: the LoRA adapter disabled, or (full fine-tuning) the frozen initial weights. When DPO
  is the first stage the two are the same model.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tempering.data import ExampleStream, encode_completion, encode_prompt, load_examples
from tempering.errors import ConfigError
from tempering.stage import Stage, check_stage
from tempering.types import Batch, Datum

REFERENCES = ("live", "precomputed")
REFERENCE_MODELS = ("base", "stage_start")
_REF_C, _REF_R = "_ref_chosen", "_ref_rejected"


def completion_datum(prompt: list[int], completion: list[int], **extra: Any) -> Datum:
    """A row that scores ``completion`` after ``prompt``: weight 1 on completion targets."""
    tokens = prompt + completion
    return Datum(tokens[:-1], tokens[1:], [0.0] * (len(prompt) - 1) + [1.0] * len(completion), extra=dict(extra))


@dataclass
class DPO(Stage):
    """Direct preference optimisation on ``dataset`` rows with ``prompt``/``chosen``/``rejected``.

    ``batch_size`` counts pairs (the backend sees ``2 x batch_size`` rows, chosen and rejected
    interleaved, see :mod:`tempering.algorithms.dpo.loss`). ``loss`` is a registered loss
    (default ``dpo``: ``{name: dpo, loss_type: sigmoid, beta: 0.1}``).
    """

    dataset: Any = field(default_factory=lambda: {"name": "synthetic_preferences"})
    prompt_key: str = "prompt"
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    batch_size: int = 16
    loss: Any = "dpo"
    reference: str = "live"
    reference_model: str = "stage_start"
    precompute_batch_size: int = 64

    label = "dpo"
    summary_keys = ("loss",)
    summary_prefixes = ("eval/", "rewards/")
    postfix = {"loss": "loss", "margin": "rewards/margins"}

    def validate(self, ctx: Any) -> None:
        path = ctx.path
        if self.reference not in REFERENCES:
            raise ConfigError(f"use one of {', '.join(REFERENCES)} (got '{self.reference}')", f"{path}.reference")
        if self.reference_model not in REFERENCE_MODELS:
            raise ConfigError(
                f"use one of {', '.join(REFERENCE_MODELS)} (got '{self.reference_model}')", f"{path}.reference_model"
            )
        if self.batch_size < 1:
            raise ConfigError(f"must be >= 1 (pairs per step), got {self.batch_size}", f"{path}.batch_size")
        if self.precompute_batch_size < 1:
            raise ConfigError(f"must be >= 1, got {self.precompute_batch_size}", f"{path}.precompute_batch_size")
        pair = {self.chosen_key: "chosen_key", self.rejected_key: "rejected_key"}
        columns = {"": {self.prompt_key: "prompt_key", **pair}}
        if self.prompt_key == "prompt":  # a chat prompt instead
            columns = {"messages": pair, **columns}
        check_stage(ctx, self, columns=columns)

    def setup(self, ctx: Any, state: Mapping[str, Any]) -> None:
        path = ctx.path
        self.loss_fn = ctx.build("loss", self.loss, "loss")
        examples = load_examples(ctx, self.dataset, "dataset")
        for key_name in ("prompt_key", "chosen_key", "rejected_key"):
            key = getattr(self, key_name)
            if examples and key not in examples[0] and not (key == "prompt" and "messages" in examples[0]):
                raise ConfigError(f"rows have no '{key}' (keys: {sorted(examples[0])})", f"{path}.{key_name}")
        start = int(state.get("step", 0))
        self.backend = backend = ctx.backend
        self.snap = f"{ctx.stage_id}/dpo_reference"
        self.live_snapshot = self.reference == "live" and self.reference_model == "stage_start"
        if self.live_snapshot:
            if not hasattr(backend, "snapshot"):
                raise ConfigError(
                    "'stage_start' with reference 'live' needs a backend with weight snapshots (e.g. local); "
                    "use reference: precomputed, or reference_model: base",
                    f"{path}.reference_model",
                )
            if start == 0:
                backend.snapshot(self.snap).result()
            elif self.snap not in backend.snapshot_names():
                raise RuntimeError(f"{path}: resuming, but the checkpoint has no '{self.snap}' snapshot")
        if self.reference == "precomputed":
            self._precompute(ctx, examples, resuming=bool(state))
        self.stream = ExampleStream(examples, seed=self.seed + ctx.seed, position=int(state.get("position", 0)))

    def loop_state(self) -> dict[str, Any]:
        return {"position": self.stream.position}

    def train_step(self, ctx: Any, step: int) -> dict[str, Any]:
        batch = self.build_batch(self.backend.tokenizer, self.stream.take(self.batch_size))
        if self.reference == "live":
            kwargs = {"weights": self.snap} if self.live_snapshot else {"reference": True}
            for d, lp in zip(batch.data, self.backend.logprobs(batch, **kwargs).result()):
                d.extra["ref_logprobs"] = list(lp)
        fb = self.backend.forward_backward(batch, self.loss_fn)
        op = self.backend.optim_step(self.adam(step))
        return {**fb.result(), **op.result()}

    def teardown(self, ctx: Any, finished: bool) -> None:
        if getattr(self, "live_snapshot", False) and finished:  # kept while the stage may still resume
            self.backend.drop_snapshot(self.snap).result()

    def eval_sampler(self) -> Any:
        return None

    # ------------------------------------------------------------------ batches
    def encode(self, tokenizer: Any, row: dict[str, Any]) -> tuple[list[int], list[int], list[int]]:
        example = dict(row)
        if self.prompt_key != "prompt" and self.prompt_key in row:
            example["prompt"] = row[self.prompt_key]
        prompt = encode_prompt(tokenizer, example)
        chosen = encode_completion(tokenizer, str(row[self.chosen_key]))
        rejected = encode_completion(tokenizer, str(row[self.rejected_key]))
        return prompt, chosen, rejected

    def build_batch(self, tokenizer: Any, rows: list[dict[str, Any]]) -> Batch:
        """Interleaved rows: ``2i`` = pair i's chosen, ``2i + 1`` its rejected; precomputed
        reference logprobs (if any) ride along as ``extra["ref_logprobs"]``."""
        data = []
        for row in rows:
            prompt, chosen, rejected = self.encode(tokenizer, row)
            c_extra = {"ref_logprobs": list(row[_REF_C])} if _REF_C in row else {}
            r_extra = {"ref_logprobs": list(row[_REF_R])} if _REF_R in row else {}
            data.append(completion_datum(prompt, chosen, **c_extra))
            data.append(completion_datum(prompt, rejected, **r_extra))
        return Batch(data, meta={"num_pairs": len(rows)})

    # ------------------------------------------------------------------ precomputed reference
    def _cache_path(self, ctx: Any) -> str:
        return os.path.join(ctx.output_dir, "dpo", f"{ctx.stage_id.replace('/', '_')}_reference.json")

    def _precompute(self, ctx: Any, examples: list[dict[str, Any]], resuming: bool) -> None:
        """Reference logprobs of every example's chosen and rejected rows, stored on the rows.

        A resumed stage reads them back from the cache written at its start: with
        ``reference_model: stage_start`` the policy has moved since, so recomputing would
        give a different reference than the uninterrupted run used.
        """
        cache = self._cache_path(ctx)
        if resuming and os.path.exists(cache):
            with open(cache, encoding="utf-8") as fh:
                refs = json.load(fh)
            if len(refs) != len(examples):
                raise RuntimeError(f"{cache}: {len(refs)} cached rows, the dataset has {len(examples)}")
        else:
            if resuming and self.reference_model == "stage_start":
                raise RuntimeError(f"{ctx.path}: resuming, but the precomputed reference cache {cache} is missing")
            refs = []
            tok = ctx.backend.tokenizer
            kwargs = {"reference": True} if self.reference_model == "base" else {}
            for start in range(0, len(examples), self.precompute_batch_size):
                batch = self.build_batch(tok, examples[start : start + self.precompute_batch_size])
                lps = ctx.backend.logprobs(batch, **kwargs).result()
                refs += [[lps[2 * i], lps[2 * i + 1]] for i in range(len(lps) // 2)]
            os.makedirs(os.path.dirname(cache), exist_ok=True)
            tmp = cache + ".tmp"
            with open(tmp, "w", encoding="utf-8") as fh:
                json.dump(refs, fh)
            os.replace(tmp, cache)
        for row, (c, r) in zip(examples, refs):
            row[_REF_C], row[_REF_R] = c, r
