"""A tinker session run, all of it: the run driven one operation at a time (run.py), what it holds between
operations (state.py), its `sample` operations (sampling.py), token sampling from logits (token_sampler.py),
a prompt's log-probs (prompt_scoring.py) and a stopping worker's hand-back (stopping.py). The losses it
trains with are pure torch in worker/algos/tinker_losses.py. They import torch, the model and engine rooms
and `service.core`, never the loops or the store."""
