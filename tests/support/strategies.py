"""A custom strategy, loaded by import path in tests."""

from __future__ import annotations

from services.sampler.building.strategies import BuildContext, Strategy


class TaggedFresh(Strategy):
    """Fresh groups like off_policy, each sample tagged so a test can see this strategy ran."""

    name = "tagged"

    async def assemble(self, ctx: BuildContext):
        samples = await super().assemble(ctx)
        for sample in samples:
            sample["tag"] = f"custom-{ctx.step}"
        return samples
