"""A verifiers harness that crashes (its program exits 1 before any model call), for fault
tests: `--env-args '{"agent": {"harness": {"id": "tandem-vf-crash"}}}'`."""

import verifiers.v1 as vf


class CrashConfig(vf.HarnessConfig):
    id: str = "tandem-vf-crash"


class CrashHarness(vf.Harness[CrashConfig]):
    NEEDS_CONTAINER = False
    EXECUTES_CODE = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **kwargs):
        return vf.ProgramResult(exit_code=1, stdout="", stderr="the crash harness crashed on purpose")


__all__ = ["CrashHarness"]
