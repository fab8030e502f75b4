"""SDPO's teacher context: which samples get a teacher, and the text it is re-prompted with.

Per sample, the teacher is the same model re-prompted with what the student did not know:

* a **solution** -- the first sibling in the sample's group (same prompt, same step) whose
  reward reached ``success_reward_threshold``, shown through ``solution_template``. With
  ``dont_reprompt_on_self_success`` a sample is never shown its own attempt: a lone success
  gets no solution (a success among several is shown another's);
* the **feedback** -- ``Sample.feedback``, what the environment or the reward said about this
  attempt in words, through ``feedback_template`` (when ``include_environment_feedback``, and
  with ``environment_feedback_only_without_solution`` only where no solution was found).

A sample with neither has no teacher signal: it is trained by the policy-gradient part alone.
The re-prompt is ``reprompt_template.format(prompt=..., solution=..., feedback=...)`` around the
student's prompt text (TRL 1.16's ``trl.experimental.sdpo`` rules and default templates).

Everything here is pure: the stage (:mod:`tempering.algorithms.sdpo.algorithm`) renders the
text with its renderer and truncates the tokens to ``max_reprompt_len``.
"""

from __future__ import annotations

import re
import string
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tempering.interfaces import Tokenizer
from tempering.schema import Problem
from tempering.types import Sample

__all__ = [
    "DEFAULT_FEEDBACK_TEMPLATE",
    "DEFAULT_REPROMPT_TEMPLATE",
    "DEFAULT_SOLUTION_TEMPLATE",
    "RepromptRules",
    "TeacherSignal",
    "choose_signals",
    "demonstration_text",
    "has_feedback",
    "reprompt_text",
    "template_problem",
    "truncate_prompt",
]

#: TRL 1.16's defaults (``SDPOConfig``).
DEFAULT_REPROMPT_TEMPLATE = "{prompt}{solution}{feedback}\n\nCorrectly solve the original question.\n"
DEFAULT_SOLUTION_TEMPLATE = "\nCorrect solution:\n\n{successful_previous_attempt}\n\n"
DEFAULT_FEEDBACK_TEMPLATE = "\nThe following is feedback from your unsuccessful earlier attempt:\n\n{feedback_raw}\n\n"

_THINKING = re.compile(r"<think>.*?</think>", flags=re.DOTALL)


@dataclass(frozen=True)
class RepromptRules:
    """The config keys that decide which samples get which signal (see the module docstring)."""

    use_successful_as_teacher: bool = True
    success_reward_threshold: float = 1.0
    dont_reprompt_on_self_success: bool = True
    include_environment_feedback: bool = True
    environment_feedback_only_without_solution: bool = False


@dataclass(frozen=True)
class Reprompt(RepromptRules):
    """The ``reprompt:`` block of the ``sdpo`` stage: which samples get a teacher, and the
    teacher's prompt (TRL's ``SDPOConfig`` names).

    The rules of :class:`RepromptRules` (who gets which signal),
    ``remove_thinking_from_demonstration``, the teacher prompt's templates (``reprompt_template``
    with ``{prompt}``, ``{solution}``, ``{feedback}``; ``solution_template`` with
    ``{successful_previous_attempt}``; ``feedback_template`` with ``{feedback_raw}``) and
    ``max_reprompt_len`` (tokens of the teacher's prompt kept: its end)."""

    remove_thinking_from_demonstration: bool = False
    max_reprompt_len: int = 10240
    reprompt_template: str = DEFAULT_REPROMPT_TEMPLATE
    solution_template: str = DEFAULT_SOLUTION_TEMPLATE
    feedback_template: str = DEFAULT_FEEDBACK_TEMPLATE

    @staticmethod
    def check_config(config: Mapping[str, Any]) -> Iterator[Problem]:
        """A cap below one token; a template that does not parse, names an unknown placeholder
        or lacks one the rules use (the teacher would never see it)."""
        if config["max_reprompt_len"] < 1:
            yield Problem(
                "max_reprompt_len",
                f"must be >= 1 (tokens of the teacher's prompt kept), got {config['max_reprompt_len']}",
            )
        for key, need, allowed in used_templates(config):
            why = template_problem(config[key], need, allowed)
            if why is not None:
                yield Problem(key, why)

    def check_encodable(self, tokenizer: Tokenizer) -> Problem | None:
        """The first template the teacher uses whose text ``tokenizer`` cannot encode."""
        for key, need, _ in used_templates(vars(self)):
            if need or key == "reprompt_template":
                why = unencodable(tokenizer, getattr(self, key))
                if why is not None:
                    return Problem(key, why)
        return None


def used_templates(config: Mapping[str, Any]) -> list[tuple[str, list[str], tuple[str, ...]]]:
    """Each template key with the placeholders the rules make it need, and those it may use."""
    required = ["prompt"]
    if config["use_successful_as_teacher"]:
        required.append("solution")
    if config["include_environment_feedback"]:
        required.append("feedback")
    solution = ["successful_previous_attempt"] if config["use_successful_as_teacher"] else []
    feedback = ["feedback_raw"] if config["include_environment_feedback"] else []
    return [
        ("reprompt_template", required, ("prompt", "solution", "feedback")),
        ("solution_template", solution, ("successful_previous_attempt",)),
        ("feedback_template", feedback, ("feedback_raw",)),
    ]


@dataclass(frozen=True)
class TeacherSignal:
    """One sample's teacher signal: ``solution`` is the index (within the group) of the sibling
    whose attempt the teacher is shown, ``feedback`` the feedback text it is shown."""

    solution: int | None = None
    feedback: str | None = None

    @property
    def active(self) -> bool:
        """Whether there is anything to re-prompt with (else: policy gradient only)."""
        return self.solution is not None or self.feedback is not None


def has_feedback(feedback: object) -> bool:
    """Feedback counts when it is a non-blank string."""
    return isinstance(feedback, str) and feedback.strip() != ""


def choose_signals(
    rewards: Sequence[float],
    feedbacks: Sequence[str | None],
    rules: RepromptRules,
    eligible: Sequence[bool] | None = None,
) -> list[TeacherSignal]:
    """Each sample's :class:`TeacherSignal` in one group (the samples of one prompt).

    ``eligible[j]`` False keeps sample ``j`` from being anyone's solution (a failed or masked
    sample: its reward is not a verdict). The solution is the *first* eligible sibling with
    ``reward >= success_reward_threshold`` in group order, itself excluded when
    ``dont_reprompt_on_self_success``."""
    n = len(rewards)
    ok = [True] * n if eligible is None else list(eligible)
    successes = [j for j in range(n) if ok[j] and rewards[j] >= rules.success_reward_threshold]  # NaN: never
    out = []
    for i in range(n):
        candidates = [j for j in successes if not (rules.dont_reprompt_on_self_success and j == i)]
        solution = candidates[0] if rules.use_successful_as_teacher and candidates else None
        use_feedback = (
            rules.include_environment_feedback
            and has_feedback(feedbacks[i])
            and not (rules.environment_feedback_only_without_solution and solution is not None)
        )
        out.append(TeacherSignal(solution, str(feedbacks[i]) if use_feedback else None))
    return out


def demonstration_text(tokenizer: Tokenizer, sample: Sample, remove_thinking: bool = False) -> str:
    """A successful sample's attempt as the text a teacher is shown.

    Single turn: its sampled tokens decoded without special tokens (what TRL shows). Multi
    turn: each model turn decoded the same way, followed by the contents of the messages the
    environment answered it with (tool results), one per line -- the episode as the student
    lived it, without any chat markup. ``remove_thinking`` drops ``<think>...</think>`` blocks."""
    traj = sample.trajectory
    if traj is None or not traj.turns:
        text = tokenizer.decode(list(sample.completion.tokens), skip_special_tokens=True)
    else:
        parts = []
        for turn in traj.turns:
            parts.append(tokenizer.decode(list(turn.completion.tokens), skip_special_tokens=True))
            parts += [str(m.get("content") or "") for m in turn.observation]
        text = "\n".join(parts)
    return _THINKING.sub("", text).strip() if remove_thinking else text


def reprompt_text(
    reprompt_template: str,
    solution_template: str,
    feedback_template: str,
    prompt: str,
    solution: str | None,
    feedback: str | None,
) -> str:
    """The teacher's text for one sample: the student's ``prompt`` text with the solution and
    the feedback put in by their templates (an absent one is the empty string)."""
    solution_part = "" if solution is None else solution_template.format(successful_previous_attempt=solution)
    feedback_part = "" if feedback is None else feedback_template.format(feedback_raw=feedback)
    return reprompt_template.format(prompt=prompt, solution=solution_part, feedback=feedback_part)


def template_problem(template: str, required: Sequence[str], allowed: Sequence[str]) -> str | None:
    """Why ``template`` cannot be used (a one-line message), or None: it must parse as a
    ``str.format`` template, name every placeholder of ``required`` and none outside ``allowed``
    (``{{`` / ``}}`` are literal braces)."""
    try:
        fields = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as err:
        return f"not a format template ({err}); write literal braces as {{{{ and }}}}"
    unknown = sorted(f for f in fields if f not in allowed)
    if unknown:
        return f"unknown placeholder {{{unknown[0]}}}; use {', '.join('{' + a + '}' for a in allowed)}"
    missing = [r for r in required if r not in fields]
    if missing:
        return f"has no {{{missing[0]}}} placeholder, so the teacher would never see it"
    return None


def unencodable(tokenizer: Tokenizer, template: str) -> str | None:
    """Why ``tokenizer`` cannot encode ``template``'s own text (its placeholders left empty), or
    None. A character-level tokenizer without an unknown token (the tiny models) raises on a
    character it lacks; found when the stage is checked, this is one line naming the template
    instead of a tokenizer's traceback at the first teacher prompt."""
    literal = "".join(text for text, *_ in string.Formatter().parse(template))
    try:
        tokenizer(literal, add_special_tokens=False)
    except Exception as err:  # noqa: BLE001 - any tokenizer's refusal, shown in the one line
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        return (
            f"this model's tokenizer cannot encode the template's text ({first}); write the template "
            "in characters the model knows (or give the model those characters)"
        )
    return None


def truncate_prompt(tokens: list[int], max_len: int) -> tuple[list[int], bool]:
    """Keep the *last* ``max_len`` tokens of a teacher prompt (TRL's rule: the end of the
    prompt, next to the continuation it conditions, is what matters most); returns the tokens
    and whether any were cut."""
    if len(tokens) <= max_len:
        return tokens, False
    return tokens[-max_len:], True
