"""An environment that fails to load, said in one line (issue 43): the environment's id, what
went wrong, and what to do when that is known. The sampler's start-up prints it and exits 2,
as it does for every bad start-up input; a traceback would bury the one thing to fix."""

from __future__ import annotations

import re

# The longest message kept: an exception can carry pages (nltk's lists every path it searched).
MAX_CHARS = 400

_NLTK_RESOURCE = re.compile(r"Resource\s+'?([\w./-]+?)'?\s+not\s+found")


class EnvironmentLoadError(ValueError):
    """Loading or building an environment failed; the message is one line that says why."""


def one_line(text: str) -> str:
    """Runs of whitespace and of banner asterisks (nltk's) as single spaces, cut to MAX_CHARS."""
    flat = " ".join(re.sub(r"\*{3,}", " ", text).split())
    return flat if len(flat) <= MAX_CHARS else flat[: MAX_CHARS - 3] + "..."


def hint(exc: BaseException) -> str | None:
    """What to do about a failure whose cause is known, or None."""
    text = str(exc)
    found = _NLTK_RESOURCE.search(text)
    if isinstance(exc, LookupError) and found:
        resource = found.group(1)
        return (f"the nltk resource {resource!r} is missing and is not downloaded here: copy it into a "
                f"directory named in NLTK_DATA (nltk.download({resource!r}, download_dir=DIR) on a machine "
                "that can reach the network)")
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        return f"install the package that provides the module {exc.name!r} in the sampler's environment"
    return None


def describe(name: str, exc: BaseException) -> str:
    """One line for `exc`, raised while environment `name` loaded. A ValueError is a refusal
    written for the user (a bad setting): it is kept, with the environment named once."""
    message = one_line(str(exc))
    if isinstance(exc, ValueError):
        return message if name in message else f"environment {name!r}: {message}"
    line = f"environment {name!r} failed to load: {type(exc).__name__}: {message or '(no message)'}"
    fix = hint(exc)
    return f"{line}; {fix}" if fix else line
