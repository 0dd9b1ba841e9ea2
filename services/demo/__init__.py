"""`tandem demo`: the whole stack (CPU inference, sampler, trainer) on one machine."""
