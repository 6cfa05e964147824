"""compare's Pareto front against a brute-force definition."""

from __future__ import annotations

import random

from frugaltrain.sim.compare import pareto_front


def test_pareto_front_is_exactly_the_undominated_points():
    rng = random.Random(0)
    for _ in range(50):
        pts = [(rng.choice([0.5, 0.6, 0.8, 1.0]), rng.choice([0.2, 0.3, 0.4])) for _ in range(7)]
        front = pareto_front(pts)
        undominated = {
            p for p in pts if not any(q[0] >= p[0] and q[1] <= p[1] and q != p for q in pts)
        }
        assert front == sorted(undominated)
        assert [u for u, _ in front] == sorted(u for u, _ in front)
