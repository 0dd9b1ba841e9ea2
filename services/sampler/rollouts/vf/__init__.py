"""verifiers environments in the sampler (`--env verifiers:<taskset-id>`, docs/environments.md).

One module per job: `loader` resolves an id and env-args into a verifiers `Env`;
`environment` runs its episodes as the sampler's trajectories; `harness` is the in-process
agent loop; `local_interception` and `local_client` keep a turn's calls to verifiers'
interception server and to the sampler's generate route in-process; `renderer` renders turns without re-tokenizing sampled ids; `sessions` ties each
rollout's model calls to its trajectory (version gate, seed, weight versions); `traces`
turns a finished trace into a sample. Importing this package imports nothing from
verifiers: the extra is optional, and only `--env verifiers:...` needs it.
"""
