"""The core's error messages in the words of the Python API.

The C++ core (and the binding's own checks) report `<op>: <argument> <problem>: got ...;
expected ...` with the names of the C++ API: the op (`linear_ce_forward`) and its arguments
(`workspace_budget`, `student`, `teacher.logits`). `python_names` wraps a public function so that
such a ValueError or RuntimeError names the function the user called and its keywords instead;
every other exception passes unchanged.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

import torch

# The core ops each public function calls.
_OPS = {
    "cross_entropy": ("ce_forward", "ce_backward"),
    "linear_cross_entropy": ("linear_ce_forward", "linear_ce_backward"),
    "distill": ("distill_forward", "distill_backward"),
    "linear_distill": ("linear_distill_forward", "linear_distill_backward"),
    "policy_loss": ("ce_forward", "ce_logprob_backward"),
    "linear_policy_loss": ("linear_ce_forward", "linear_ce_backward", "linear_policy_forward"),
}

# Per public function: the core's argument names that differ from its Python keywords. Names not
# listed are the same in both (logits, target, label_smoothing, class_weight, ...).
KEYWORDS = {
    "cross_entropy": {},
    # grads.weight is a buffer of the caller only when it is accumulate_into.
    "linear_cross_entropy": {
        "workspace_budget": "workspace_bytes",
        "grads.weight": "accumulate_into",
    },
    "distill": {"student": "student_logits", "teacher": "teacher_logits"},
    "linear_distill": {
        "workspace_budget": "workspace_bytes",
        "teacher.logits": "teacher_logits",
        "teacher.hidden": "teacher_hidden",
        "teacher.weight": "teacher_weight",
        # The core's `teacher` is the choice between the two forms.
        "teacher": "teacher_logits or teacher_hidden",
    },
    "policy_loss": {},
    "linear_policy_loss": {"workspace_budget": "workspace_bytes"},
}


def _renamer(function: str) -> Callable[[str], str]:
    names = KEYWORDS[function]
    if not names:
        return lambda text: text
    # Whole names only (not `student` inside `student_hidden`), longest first.
    pattern = re.compile(
        r"(?<![\w.])("
        + "|".join(re.escape(name) for name in sorted(names, key=len, reverse=True))
        + r")(?![\w.])"
    )
    return lambda text: pattern.sub(lambda match: names[match.group(1)], text)


def translate(function: str, message: str) -> str:
    """`message` with the op and argument names of the core replaced by those of `function`;
    unchanged when it does not come from one of that function's ops."""
    for op in _OPS[function]:
        if message.startswith(op + ": "):
            return function + ": " + _RENAMERS[function](message[len(op) + 2 :])
    return message


_RENAMERS = {function: _renamer(function) for function in KEYWORDS}


def python_names(fn: Callable) -> Callable:
    """Decorates the public function `fn` (named as in KEYWORDS) so that the core's ValueError /
    RuntimeError messages name `fn` and its keywords."""
    function = fn.__name__

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # traced by torch.compile: no try/except to trace
            return fn(*args, **kwargs)
        try:
            return fn(*args, **kwargs)
        except (ValueError, RuntimeError) as error:
            message = str(error)
            renamed = translate(function, message)
            if renamed == message or type(error) not in (ValueError, RuntimeError):
                raise
            raise type(error)(renamed).with_traceback(error.__traceback__) from None

    return wrapper
