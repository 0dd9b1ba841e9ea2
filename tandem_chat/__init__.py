"""The `tandem-chat` verifiers harness (services/sampler/rollouts/vf/harness.py): verifiers resolves a
harness id to a top-level module of that name (`tandem-chat` -> `tandem_chat`)."""

from services.sampler.rollouts.vf.harness import TandemChatConfig, TandemChatHarness

__all__ = ["TandemChatHarness", "TandemChatConfig"]
