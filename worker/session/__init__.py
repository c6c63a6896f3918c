"""What a tinker session run needs beyond the loops: token sampling from logits (token_sampler.py), a
prompt's log-probs (prompt_scoring.py) and a stopping worker's hand-back (stopping.py). They import torch
and `service.core`, never the store."""
