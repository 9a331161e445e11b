"""Defaults of a training run that ``moment train``'s help shows: here, apart from
:class:`trainer.config.TrainConfig` (which imports torch), so that building the CLI's parser
imports no torch, and both read the one value."""

EPOCHS = 3  # total epochs, counting those a resumed checkpoint already did
