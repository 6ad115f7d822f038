"""The one rule for a configuration key that picks between a fast kernel of this package and torch's.

`auto` takes the fast kernel where it can run and says why not otherwise; naming the fast kernel where it cannot run
stops the run with the reason and the fix; `torch` (or the key's plain way) is always taken. model.norm,
optim.kernel and train.weights use it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from .errors import UserError


@functools.cache
def triton_import_problem() -> str | None:
    """None when Triton imports, else why not (the Triton kernels need it; torch's CUDA wheels ship it)."""
    try:
        import triton.language  # noqa: F401
    except Exception as e:  # a broken install raises more than ImportError
        return f"{type(e).__name__}: {e}"
    return None


def choose_kernel(key: str, name: str, fast: str, what: str, problem: Callable[[], str | None],
                  plain: str = "torch") -> tuple[str, str]:
    """(kind, why) for `key`=`name` among auto, `plain` (torch's way, always possible) and `fast` (described by
    `what`); `problem` says why the fast way cannot run here, or None, and is only asked when it matters."""
    kinds = ("auto", plain, fast)
    if name not in kinds:
        raise UserError(f"{key}={name!r}; choose one of {', '.join(kinds)}")
    if name == plain:
        return plain, f"{plain} (asked for)"
    why_not = problem()
    if why_not is None:
        return fast, f"{fast} ({what}) ({'auto' if name == 'auto' else 'asked for'})"
    if name == "auto":
        return plain, f"{plain} (auto: {why_not})"
    raise cannot_run(key, fast, why_not, plain)


def cannot_run(key: str, fast: str, why_not: str, plain: str = "torch") -> UserError:
    """The error for `key`=`fast` where that way cannot run: the reason and the fix."""
    return UserError(f"{key}={fast} cannot run here ({why_not}); set {key}=auto or {plain}")
