"""Stage 3: datasets, pre-sampling hotness, DDAK placement, the placed layout on disk."""
