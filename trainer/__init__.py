"""Stage 4: sampler, tiered feature store, models and the DDP loop (`python -m trainer`)."""
