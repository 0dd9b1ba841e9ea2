"""Rollouts and environments: from prompts to scored groups (requests, parsing, rewards,
advantages, seeds), single- and multi-turn, native, verifiers and plugin environments. May
import fleet, storage and config; never building, observability or api."""
