"""Step-time cost models shared by the engine (chunk sizing) and the router (policies, simulator).

A leaf package: numpy only; it imports nothing from ``engine``, ``router``, ``services`` or
``kvstore``. See ``costmodel.models`` for the formulas and default coefficients.
"""

from costmodel.models import DEFAULT_CHUNK_BUDGET, CostModel, DecodeCostModel

__all__ = ["DEFAULT_CHUNK_BUDGET", "CostModel", "DecodeCostModel"]
