"""An environment whose prompts are HTML, to prove the dashboard shows them as text."""

from __future__ import annotations

from services.sampler.rollouts.envs.base import Completion, Environment, Example, Reward

# If the dashboard ever put this into innerHTML, the onerror handler (or the script, in
# browsers that run it) would set window.__pwned and an <img> would appear in the table.
PAYLOAD = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2"><b>bold?</b>'


async def _has_digit(example: Example, completion: Completion) -> float:
    return float(any(ch.isdigit() for ch in completion.text))


class HtmlEnv(Environment):
    name = "html"
    rewards = (Reward("digit", _has_digit, 1.0),)

    def examples(self, split):
        return [Example(f"html/{split}/{i}", f"{PAYLOAD} count {i}", answer=i) for i in range(20)]
