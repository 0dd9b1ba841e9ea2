"""The sampler's side of multi-turn rollouts, one module per job:

* render.py: environment messages -> token ids with the served model's chat template,
  appended after the ids the model sampled (never re-tokenizing them).
* conversation.py: runs one trajectory turn by turn and builds its one sample.
* tools.py: runs the model's tool calls with timeouts; errors become tool messages.
* workers.py: the worker threads that keep synchronous environment code off the event loop.
* stats.py: per-environment counters of turns, tool calls, errors, retries and drops.

The environment's interface is services/sampler/rollouts/envs/multiturn.py.
"""
