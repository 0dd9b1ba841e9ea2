"""Rendering environment turns: what the model sampled of the template's turn closing is not
written twice, and a chat template that does not render conversations as prefixes of their
continuations is refused with a message that says so (never silently mis-rendered)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from services.inference.testing import running_server
from services.sampler.rollouts.multiturn.render import closing_overlap
from tests.support.envs import EchoDialogue

pytestmark = pytest.mark.timeout(120)

IM_END, NL = 2, 99


@pytest.mark.parametrize("sampled, expected", [
    ([10, 11, IM_END], 1),        # ended with the end-of-turn token: only "\n" is left to write
    ([10, 11], 0),                # cut off by max_tokens: the whole closing is written
    ([10, IM_END, NL], 2),        # sampled the whole closing itself
    ([], 0),
    ([NL], 0),                    # a newline alone is not the start of the closing
])
def test_closing_overlap(sampled, expected):
    assert closing_overlap(sampled, [IM_END, NL]) == expected


# Renders the final assistant message differently from the same message followed by others
# (as templates that strip reasoning from history do): no turn can be appended token-exactly.
UNSTABLE = ("{%- for m in messages -%}"
            "{%- if loop.last and m['role'] == 'assistant' -%}{{- 'LAST ' + m['content'] -}}"
            "{%- else -%}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}{%- endif -%}"
            "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")


@pytest.fixture
def unstable_server(tiny_model: Path, tmp_path: Path):
    model = tmp_path / "unstable"
    shutil.copytree(tiny_model, model)
    (model / "chat_template.jinja").write_text(UNSTABLE)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = UNSTABLE
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    with running_server(model, served_model_name="tiny") as handle:
        yield handle


async def test_a_template_that_is_not_prefix_stable_is_refused_naming_why(unstable_server, make_rollouts):
    rollouts = make_rollouts(EchoDialogue(max_turns=2), [unstable_server.base_url], max_tokens=2, env_retries=0)
    group = await rollouts.group(EchoDialogue().examples("train")[0], "g0", min_version=0, seed=0, n=1)
    assert group.invalid is not None and "prefixes of their continuations" in group.invalid, group.invalid
    assert "TemplateError" in rollouts.env_stats.of("echo_dialogue").last_error
