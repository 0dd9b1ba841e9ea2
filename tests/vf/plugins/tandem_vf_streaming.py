"""A verifiers harness that talks to the model as verifiers' stock chat program does: its own
`chat()` (verifiers.v1.harnesses.utils.core), streaming (`stream: true`, usage included),
in-process instead of a `uv` script. With verifiers' eval client the interception server
relays that stream from the inference server: what `vf-eval` against Tandem's CPU server
needs (id `tandem-vf-streaming`)."""

import verifiers.v1 as vf
from openai import AsyncOpenAI
from verifiers.v1.harnesses.utils.core import chat


class StreamingConfig(vf.HarnessConfig):
    id: str = "tandem-vf-streaming"


class StreamingHarness(vf.Harness[StreamingConfig]):
    APPENDS_SYSTEM_PROMPT = True
    NEEDS_CONTAINER = False
    EXECUTES_CODE = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **kwargs):
        system, prompt = self.resolve_prompt(data)
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        async with AsyncOpenAI(base_url=endpoint, api_key=secret) as client:
            completion = await chat(client, ctx.model, messages, [])
        reply = completion.choices[0].message.content or ""
        return vf.ProgramResult(exit_code=0, stdout=reply, stderr="")


__all__ = ["StreamingHarness"]
