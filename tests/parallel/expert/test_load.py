"""The load table against its definition: routed = the top-K choices counted per expert (from
topi, not route's expert array), kept = min(routed, C) per routing group (slots fill from 0, so
an expert keeps its first C choices), dropped = the rest; imbalance = max / mean."""

import numpy as np
import pytest

from emulator import moe
from parallel.expert.load import format_load, load_table, received
from tests.parallel.expert.helpers import params


@pytest.mark.parametrize("K,cf,groups", [(1, 0.5, 1), (2, 1.0, 2), (3, 0.25, 3), (2, 0.0, 1)])
def test_load_table_definition(K, cf, groups):
    rng = np.random.default_rng(K)
    E, N = 4, 12
    mp, u = params(rng, 3, 4, E), rng.normal(size=(groups * N, 3))
    routes = [moe.route(u[g * N : (g + 1) * N], mp["router"], K, cf) for g in range(groups)]
    t = load_table(routes, E)
    routed = [np.bincount(r["topi"].reshape(-1), minlength=E) for r in routes]
    C = moe.capacity(N, K, E, cf)
    assert np.array_equal(t["routed"], sum(routed))
    assert np.array_equal(t["kept"], sum(np.minimum(x, C) for x in routed))
    assert np.array_equal(t["dropped"], sum(np.maximum(x - C, 0) for x in routed))
    assert t["routed"].sum() == groups * N * K and t["capacity"] == [C] * groups
    assert t["imbalance_routed"] == pytest.approx(t["routed"].max() / (groups * N * K / E))
    if cf == 0.0:
        assert t["imbalance_kept"] == 0.0 and t["kept"].sum() == 0
    text = format_load(t, 2, received(np.array([[1, 2], [3, 4]])))
    assert text.splitlines()[2].split() == ["0", *map(str, (t["routed"][0], t["kept"][0],
                                                           t["dropped"][0]))]  # fmt: skip
    assert text.splitlines()[4].split()[-1] == "4"  # expert 2 is local: 1 + 3 rows arrived
