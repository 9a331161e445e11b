"""Bundled topology profiles (YAML): the Moment paper's machines and profiles of real captures."""
