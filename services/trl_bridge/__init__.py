"""Tandem as the data source of TRL's `GRPOTrainer` (the `trl` extra: `pip install -e '.[trl]'`).

`TandemGRPOTrainer` (trainer.py) replaces TRL's generate-and-score step with `GET /batch?step=N`
and publishes every new version through the sampler; everything else (optimizer, gradient
accumulation, logging, callbacks, checkpoints, `accelerate launch`) stays TRL's and
`transformers`'. The pieces, one job each:

* `sampler_link.py`: a synchronous face on the async `SamplerClient` (TRL's loop is synchronous);
* `agreement.py`: the start-up checks, the contract's rules applied to a `GRPOConfig`;
* `inputs.py`: a sampler batch -> the padded tensors TRL's loss reads;
* `publication.py`: weights out, with the probe, to `POST /weights_version`;
* `trainer.py`: the subclass and the callback that publishes after each optimizer step.

Importing this package imports neither torch nor TRL: `from services.trl_bridge.trainer import
TandemGRPOTrainer` does.
"""
