"""A fixed, stratified sample of cases: what ``pool_overhead.py`` times instead of the whole default run.

The default run has hundreds of cases, too many to start fresh processes for
each. The benchmark times a sample of about 20 instead, and the sample must
look like the run: every hook API at every world size, in proportion to how
many cases each has. :func:`stratified_sample` draws it:

* strata are given by a key function (the benchmark uses ``(api, world_size)``);
* every stratum gets one case, and the rest of the sample is shared out in
  proportion to the strata's sizes (largest remainder; ties go to the
  stratum whose key sorts first);
* within a stratum the cases are drawn with ``random.Random(seed)``, so a
  seed always draws the same sample from the same cases;
* the sample keeps the population's order (the order the suite runs them in).

Small strata (the default run's 4-rank cases) are therefore over-represented:
a floor of one case is what makes "every API at every world size" true.
"""

from __future__ import annotations

import random
from collections import defaultdict
from typing import Callable, Dict, Hashable, List, Sequence, TypeVar

T = TypeVar("T")

__all__ = ["allocate", "stratified_sample"]


def allocate(sizes: Dict[Hashable, int], n: int) -> Dict[Hashable, int]:
    """How many cases each stratum gives to a sample of ``n``.

    Args:
        sizes: stratum key -> number of cases in it (each at least 1).
        n: the sample size; at least the number of strata.

    Returns:
        stratum key -> cases to draw: at least 1 each, never more than the
        stratum holds, summing to ``min(n, sum(sizes.values()))``.

    Raises:
        ValueError: ``n`` is smaller than the number of strata, or a stratum is empty.
    """
    if any(size < 1 for size in sizes.values()):
        raise ValueError(f"every stratum needs at least one case: {sizes}")
    if n < len(sizes):
        raise ValueError(f"a sample of {n} cannot cover {len(sizes)} strata; ask for at least {len(sizes)}")
    total = sum(sizes.values())
    if n >= total:
        return dict(sizes)
    keys = sorted(sizes, key=repr)
    counts = {k: 1 for k in keys}
    rest = n - len(keys)
    ideal = {k: rest * sizes[k] / total for k in keys}
    for k in keys:
        counts[k] += min(int(ideal[k]), sizes[k] - 1)
    leftover = n - sum(counts.values())
    # Largest remainder first; a full stratum passes its turn to the next.
    order = sorted(keys, key=lambda k: (-(ideal[k] - int(ideal[k])), repr(k)))
    while leftover:
        for k in order:
            if leftover and counts[k] < sizes[k]:
                counts[k] += 1
                leftover -= 1
    return counts


def stratified_sample(cases: Sequence[T], stratum: Callable[[T], Hashable], n: int, seed: int) -> List[T]:
    """``n`` of ``cases`` (all of them if there are fewer), drawn per stratum as :func:`allocate` says.

    The result keeps the order of ``cases``. The same ``cases``, ``n`` and
    ``seed`` always give the same sample.

    Raises:
        ValueError: from :func:`allocate`.
    """
    members: Dict[Hashable, List[int]] = defaultdict(list)
    for index, case in enumerate(cases):
        members[stratum(case)].append(index)
    counts = allocate({k: len(v) for k, v in members.items()}, n)
    rng = random.Random(seed)
    chosen: List[int] = []
    for key in sorted(members, key=repr):
        chosen += rng.sample(members[key], counts[key])
    return [cases[i] for i in sorted(chosen)]
