"""One parser per tool; each takes saved text (or live sysfs) and returns source-neutral records."""
