"""Stage 1: the machine model, its profile format, and the profilers that build it."""
