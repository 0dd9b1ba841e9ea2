"""verifiers' own eval path against Tandem's CPU inference server, without the sampler: its
eval client relaying a streamed chat completion (`stream: true`, which the server used to
refuse) to a harness that reads it as verifiers' stock chat program does."""

from __future__ import annotations

import pytest

from services.inference.testing import running_server

pytestmark = pytest.mark.timeout(120)


async def test_verifiers_eval_client_streams_from_the_cpu_server(tiny_model) -> None:
    import verifiers.v1 as vf

    with running_server(tiny_model, served_model_name="tiny") as server:
        config = vf.resolve_env_config({"taskset": {"id": "tandem-vf-parity", "size": 4},
                                        "agent": {"harness": {"id": "tandem-vf-streaming"},
                                                  "runtime": {"type": "subprocess"}}})
        env = vf.load_environment(config)
        client = vf.EvalClientConfig(base_url=server.base_url, api_key_var="TANDEM_NO_KEY")
        ctx = vf.ModelContext(model="tiny", client=client, sampling=vf.SamplingConfig(max_tokens=4, temperature=1.0))
        async with env.serving():
            episodes = [await env.run_episode(task, ctx) for task in list(env.taskset)[:2]]
    for episode in episodes:
        assert episode.ok, [e.message for e in episode.errors] + [e.message for t in episode.traces for e in t.errors]
        (trace,) = episode.traces
        (call,) = trace.calls
        assert call.error is None and call.finish_reason in ("stop", "length")
        assert 1 <= call.usage.completion_tokens <= 4  # the stream's usage chunk reached the trace
        assert set(trace.rewards) == {"correct"} and trace.metrics["reply_chars"] == len(trace.last_reply)
