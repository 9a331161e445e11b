"""``python -m trainer ...`` (what torchrun starts on every rank): see ``trainer.loop.main``."""

import sys

from trainer.loop import main

sys.exit(main())
