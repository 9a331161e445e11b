"""Named, seeded split conventions for datasets that ship none (IGB), over the labelled vertices.

``L`` is the number of labelled vertices, which are the ids 0..L-1 (IGB labels a prefix). Each
convention draws one permutation ``perm = torch.randperm(L)`` from a ``torch.Generator`` seeded with
the seed — the same ids as a script that calls ``torch.manual_seed(seed)`` and then
``torch.randperm(L)`` — and cuts it:

* ``mlperf`` (seed 42): MLPerf GNN's ``split_seeds.py``: train = perm[:int(0.6 L)], val = the next
  int(0.005 L) (its command-line default ``--validation_frac``). MLPerf has no test split; moment's
  test is the next int(0.005 L) of the same permutation (disjoint, the size of val).
* ``igb`` (seed 0, as IGB's training scripts set): the IGB loader's 60/20/20 proportions,
  train = perm[:int(0.6 L)], val = the next int(0.2 L), test = the rest. IGB's own loader takes
  contiguous id ranges, unshuffled (IGB-Datasets PR #63 calls this "not properly shuffled"): here
  they are shuffled.
* ``fraction:F`` (seed 0): train = perm[:round(F L)], val and test the next round(F L / 2) each
  (F = 0.01 is the 1 % of the Moment paper's runs, like ``moment dataset synth``).

Every split is saved sorted (int64). The permutation takes 8 bytes per labelled vertex in RAM.
"""

from __future__ import annotations

import numpy as np

from moment.errors import UsageError

CONVENTIONS = ("mlperf", "igb", "fraction:F")
DEFAULT_SEED = {"mlperf": 42, "igb": 0, "fraction": 0}


def parse(text: str) -> tuple[str, float | None]:
    """``mlperf`` / ``igb`` / ``fraction:0.01`` → (name, fraction); a UsageError otherwise."""
    name, _, arg = text.partition(":")
    if name in ("mlperf", "igb") and not arg:
        return name, None
    if name == "fraction":
        try:
            f = float(arg)
        except ValueError:
            f = -1.0
        if f > 0 and 2 * f <= 1:
            return name, f
        raise UsageError(f"--split {text}: F must be a number in (0, 0.5], e.g. fraction:0.01")
    raise UsageError(f"--split {text}: expected one of {', '.join(CONVENTIONS)}")


def sizes(text: str, labelled: int) -> tuple[int, int, int]:
    """(train, val, test) sizes of a convention over ``labelled`` vertices."""
    name, f = parse(text)
    if name == "mlperf":
        return int(labelled * 0.6), int(labelled * 0.005), int(labelled * 0.005)
    if name == "igb":
        train, val = int(labelled * 0.6), int(labelled * 0.2)
        return train, val, labelled - train - val
    assert f is not None
    return max(1, round(f * labelled)), round(f * labelled / 2), round(f * labelled / 2)


def prepare() -> None:
    """Import torch ahead of :func:`draw` (seconds; an importer runs it in a thread meanwhile)."""
    import torch  # noqa: F401


def draw(text: str, labelled: int, seed: int | None = None) -> dict[str, np.ndarray]:
    """The three splits of a convention, sorted vertex ids (seed: the convention's default if None)."""
    import torch  # here: the CLI's parser reads this package, and torch takes seconds to import

    name, _ = parse(text)
    seed = DEFAULT_SEED[name] if seed is None else seed
    perm = torch.randperm(labelled, generator=torch.Generator().manual_seed(seed)).numpy()
    train, val, test = sizes(text, labelled)
    cut = np.cumsum([0, train, val, test])
    return {key: np.sort(perm[a:b]).astype(np.int64) for key, a, b in zip(("train", "val", "test"), cut, cut[1:])}
